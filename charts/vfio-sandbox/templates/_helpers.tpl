{{/* The name of an object of this release: NAME<nameSuffix>. */}}
{{- define "vfio-sandbox.name" -}}
{{- printf "%s%s" .name .root.Values.nameSuffix -}}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "vfio-sandbox.labels" -}}
app.kubernetes.io/part-of: vfio-sandbox
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
{{- end }}

{{/* Labels of one agent's objects and pods; .name is the agent. */}}
{{- define "vfio-sandbox.agentLabels" -}}
{{ include "vfio-sandbox.labels" .root }}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/component: {{ .name }}
{{- end }}

{{- define "vfio-sandbox.selector" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{- define "vfio-sandbox.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) | quote }}
{{- end }}

{{/* A host directory under hostPaths.run: .dir with nameSuffix where .suffixed. */}}
{{- define "vfio-sandbox.runDir" -}}
{{ printf "%s/%s" (trimSuffix "/" .root.Values.hostPaths.run) .dir }}
{{- end }}

{{- define "vfio-sandbox.managerDir" -}}
{{ include "vfio-sandbox.runDir" (dict "root" . "dir" (printf "vfio-manager%s" .Values.nameSuffix)) }}
{{- end }}
{{- define "vfio-sandbox.validationsDir" -}}
{{ include "vfio-sandbox.runDir" (dict "root" . "dir" (printf "vfio-sandbox%s/validations" .Values.nameSuffix)) }}
{{- end }}
{{- define "vfio-sandbox.ownerDir" -}}
{{ include "vfio-sandbox.runDir" (dict "root" . "dir" (printf "vfio-sandbox%s/owner" .Values.nameSuffix)) }}
{{- end }}
{{- define "vfio-sandbox.draStateDir" -}}
{{ include "vfio-sandbox.runDir" (dict "root" . "dir" "sandbox-dra-driver") }}
{{- end }}

{{- define "vfio-sandbox.restoreLabel" -}}
{{ .Values.vfioManager.restoreLabel | default (printf "vfio-sandbox.rebellions.ai/vfio-manager%s.restore-pending" .Values.nameSuffix) }}
{{- end }}

{{/* The label that puts a VM-mode agent (.agent) on a node, as key=value. */}}
{{- define "vfio-sandbox.vmModeKey" -}}
{{- if eq .root.Values.nodeSelection.by "workload" -}}
{{ .root.Values.nodeSelection.workloadLabel }}
{{- else -}}
{{ printf "%s.%s" .root.Values.nodeSelection.deployLabelPrefix .agent }}
{{- end }}
{{- end }}
{{- define "vfio-sandbox.vmModeValue" -}}
{{- if eq .root.Values.nodeSelection.by "workload" -}}
{{ .root.Values.nodeSelection.workloadValue }}
{{- else -}}
true
{{- end }}
{{- end }}

{{/* The platforms of the image (one manifest list). */}}
{{- define "vfio-sandbox.platform" -}}
- key: kubernetes.io/os
  operator: In
  values: ["linux"]
- key: kubernetes.io/arch
  operator: In
  values: ["amd64", "arm64"]
{{- end }}

{{/* The resource list as JSON. */}}
{{- define "vfio-sandbox.config" -}}
{{- $cfg := dict -}}
{{- with .Values.config.preset }}{{ $_ := set $cfg "preset" . }}{{ end -}}
{{- with .Values.config.naming }}{{ $_ := set $cfg "naming" . }}{{ end -}}
{{- with .Values.sandboxDevicePlugin.resourceList }}{{ $_ := set $cfg "resources" . }}{{ end -}}
{{ toJson $cfg }}
{{- end }}

{{/* Pod annotations: the resource list's checksum (a change rolls the
agents: they read it once at start) and, with metrics, Prometheus' hints. */}}
{{- define "vfio-sandbox.podAnnotations" -}}
checksum/config: {{ include "vfio-sandbox.config" .root | sha256sum | trunc 16 }}
{{- if and .root.Values.metrics.enabled .port }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

