# Container image for the vfio-sandbox node agents (vfio-manager,
# sandbox-validator, sandbox-device-plugin and sandbox-dra-driver) and the DRA
# driver's cluster-wide claim labeller (sandbox-dra-controller), one image for
# all of them.
#
# Multi-arch: linux/amd64 and linux/arm64 (Grace-based nodes, where
# nvgrace_gpu_vfio_pci lives). Both runtime targets are FROM scratch plus
# COPY, so no stage ever runs a foreign binary and no emulation is needed.
#
# Two ways to build the same FROM-scratch runtime image:
#
#   1. Everything inside the build (default target `runtime`). The builder
#      runs on the build machine's platform ($BUILDPLATFORM) and
#      cross-compiles for $TARGETARCH with Debian's cross gcc when the two
#      differ:
#        docker buildx build --platform linux/amd64,linux/arm64 -t vfio-sandbox .
#
#   2. From static binaries already built on the host (target
#      `runtime-prebuilt`), for machines that cannot pull the Rust builder
#      image. The build context is a directory holding
#      `bin/<TARGETARCH>/<binary>` (`bin/amd64/`, `bin/arm64/`):
#        scripts/build-static.sh --arch x86_64    # prints target/x86_64-unknown-linux-gnu/release
#        scripts/build-static.sh --arch aarch64   # prints target/aarch64-unknown-linux-gnu/release
#        mkdir -p ctx/bin/amd64 ctx/bin/arm64     # copy the binaries each one lists
#        docker buildx build --platform linux/amd64,linux/arm64 \
#            --target runtime-prebuilt -t vfio-sandbox ctx
#      scripts/image.sh does exactly this with buildah (one build per
#      platform, joined in a manifest list) and then checks the images;
#      CI runs it on the test bed's static binaries (--profile testbed).
#
# The binaries are static (glibc, +crt-static), so the runtime stage needs no
# libc, no shell and no modprobe: vfio-manager loads kernel modules itself with
# finit_module(2) from the host's /lib/modules, mounted into the container.

############################################################################
# Builder: every node agent, statically linked for $TARGETARCH.
############################################################################
FROM --platform=$BUILDPLATFORM rust:1-bookworm AS builder

ARG TARGETARCH
ARG BUILDARCH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Cross toolchain when the target differs from the build machine: Debian's
# gcc for the target links the binaries and compiles C code of dependencies
# (ring, with rustls); its libc.a links them statically. The versions come
# with the builder image's Debian release.
# hadolint ignore=DL3008
RUN case "$TARGETARCH" in \
        amd64) gnu=x86_64 ;; \
        arm64) gnu=aarch64 ;; \
        *) echo "unsupported TARGETARCH=$TARGETARCH" >&2; exit 1 ;; \
    esac \
 && rustup target add "$gnu-unknown-linux-gnu" \
 && if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
        apt-get update \
     && apt-get install -y --no-install-recommends \
            "gcc-${gnu//_/-}-linux-gnu" "libc6-dev-$TARGETARCH-cross" \
     && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /src
COPY . .

# The gnu target is spelled out so RUSTFLAGS apply to the binaries only (not
# to build scripts and proc macros, which run on the build machine).
# Only the node agents are built and gathered in /out/bin; the workspace's test
# tools (kubelet-peer, plugin-bench) stay out of the image.
RUN case "$TARGETARCH" in amd64) gnu=x86_64 ;; arm64) gnu=aarch64 ;; esac \
 && target="$gnu-unknown-linux-gnu" \
 && if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
        tvar="${target//-/_}" \
     && export "CARGO_TARGET_${tvar^^}_LINKER=$gnu-linux-gnu-gcc" \
            "CC_$tvar=$gnu-linux-gnu-gcc" "AR_$tvar=$gnu-linux-gnu-ar"; \
    fi \
 && RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --release --locked --target "$target" \
        -p vfio-manager -p sandbox-validator -p sandbox-device-plugin \
        -p sandbox-dra-driver -p sandbox-dra-controller \
 && mkdir -p /out/bin \
 && for b in vfio-manager sandbox-validator sandbox-device-plugin sandbox-dra-driver sandbox-dra-controller; do \
        cp "target/$target/release/$b" /out/bin/; \
    done \
 && ls -l /out/bin

############################################################################
# Runtime base: metadata shared by both runtime targets. Empty filesystem.
############################################################################
FROM scratch AS runtime-base

ARG VERSION=0.1.0
ARG REVISION=unknown

LABEL org.opencontainers.image.title="vfio-sandbox" \
      org.opencontainers.image.description="Node agents that move PCI accelerators (Rebellions NPUs, NVIDIA GPUs) to vfio-pci for KubeVirt VM passthrough, and put them back" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# There is no /bin/sh to resolve names through: commands are exec'd directly.
ENV PATH=/usr/bin

# USER 0: these are privileged node agents. vfio-manager writes to
# /sys/bus/pci (driver_override, unbind, drivers_probe), loads and unloads
# kernel modules (finit_module / delete_module need CAP_SYS_MODULE) and
# creates its state under the host's /run; the device plugin and the DRA
# driver serve sockets in kubelet's root-owned plugin directories, and the
# DRA driver rebinds devices and writes CDI specs under /var/run/cdi. None of
# that works as an unprivileged user, so say it explicitly instead of relying
# on a default (hence no DL3002 from hadolint).
# hadolint ignore=DL3002
USER 0

CMD ["vfio-manager", "--help"]

############################################################################
# Runtime from host-built binaries: context directory with
# bin/<TARGETARCH>/<binary>.
############################################################################
FROM runtime-base AS runtime-prebuilt
ARG TARGETARCH
COPY bin/${TARGETARCH}/ /usr/bin/

############################################################################
# Runtime from the builder stage (default target: last in the file).
############################################################################
FROM runtime-base AS runtime
COPY --from=builder /out/bin/ /usr/bin/
