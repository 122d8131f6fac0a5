# Container image for the vfio-sandbox node agents (vfio-manager, and later
# sandbox-validator and sandbox-device-plugin), one image for all of them.
#
# Two ways to build the same FROM-scratch runtime image:
#
#   1. Everything inside the build (default target `runtime`):
#        docker build -t vfio-sandbox .
#
#   2. From static binaries already built on the host (target
#      `runtime-prebuilt`), for machines that cannot pull the Rust builder
#      image. The build context is a directory holding `bin/<binary>`:
#        scripts/build-static.sh           # prints target/x86_64-unknown-linux-gnu/release
#        mkdir -p ctx/bin && cp <the binaries it lists> ctx/bin/
#        docker build -f Dockerfile --target runtime-prebuilt -t vfio-sandbox ctx
#      scripts/image.sh does exactly this with buildah and then runs the image.
#
# The binaries are static (glibc, +crt-static), so the runtime stage needs no
# libc, no shell and no modprobe: vfio-manager loads kernel modules itself with
# finit_module(2) from the host's /lib/modules, mounted into the container.

############################################################################
# Builder: every binary of the workspace, statically linked.
############################################################################
FROM rust:1-bookworm AS builder

WORKDIR /src
COPY . .

# The gnu target is spelled out so RUSTFLAGS apply to the binaries only (not
# to build scripts and proc macros, which run on the build machine).
# Only the node agents are built and gathered in /out/bin; the workspace's test
# tools (kubelet-peer, plugin-bench) stay out of the image.
RUN RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --release --locked --target x86_64-unknown-linux-gnu \
        -p vfio-manager -p sandbox-validator -p sandbox-device-plugin \
 && mkdir -p /out/bin \
 && for b in vfio-manager sandbox-validator sandbox-device-plugin; do \
        cp "target/x86_64-unknown-linux-gnu/release/$b" /out/bin/; \
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
# creates its state under the host's /run; the device plugin serves a socket
# in kubelet's root-owned device-plugins directory. None of that works as an
# unprivileged user, so say it explicitly instead of relying on a default.
USER 0

CMD ["vfio-manager", "--help"]

############################################################################
# Runtime from host-built binaries: context directory with bin/<binary>.
############################################################################
FROM runtime-base AS runtime-prebuilt
COPY bin/ /usr/bin/

############################################################################
# Runtime from the builder stage (default target: last in the file).
############################################################################
FROM runtime-base AS runtime
COPY --from=builder /out/bin/ /usr/bin/
