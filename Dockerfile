# Kylin as a service: `kylin serve` in a small Debian image, as a non-root user, models mounted
# read-only. Build (Docker, Podman or Buildah, from the repository root):
#
#   podman build -t kylin .
#   podman run --rm -p 8080:8080 -v ~/.cache/kylin-models/qwen2.5-coder-0.5b-instruct:/models/model:ro kylin
#
# The binary is built for a portable x86-64 level (x86-64-v3: AVX2 and FMA, every x86 server of
# the last decade); Kylin's own kernels still pick AVX-512, VNNI, BF16 and AMX at run time where
# the CPU has them. llama.cpp (GGUF files) is built for the same level, since the Rust flags
# below replace `.cargo/config.toml`'s `target-cpu=native`.

# Where no image registry is reachable, import a Debian root made with debootstrap and pass
# `--build-arg RUN_IMAGE=localhost/debian-bookworm` (and a build image with Rust, cmake and nasm).
ARG BUILD_IMAGE=docker.io/library/rust:1-bookworm
ARG RUN_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends cmake clang libclang-dev nasm \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
ENV RUSTFLAGS="-C target-cpu=x86-64-v3"
RUN cargo build --release --locked -p kylin-cli \
 && strip target/release/kylin \
 && target/release/kylin --version

FROM ${RUN_IMAGE}
# libgomp: llama.cpp's threads; curl: the health check.
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libgomp1 curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kylin
COPY --from=build /src/target/release/kylin /usr/local/bin/kylin
USER 10001:10001
EXPOSE 8080
# Mount a model directory (or a GGUF file) at /models/model, read-only.
VOLUME ["/models"]
# /health answers 200 once the model is loaded (503 while loading or shutting down); a large
# model may take minutes to map and prefault, hence the start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
  CMD curl -fsS http://127.0.0.1:8080/health >/dev/null || exit 1
# SIGTERM lets running requests finish within the grace period (`kylin serve --help`).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kylin", "serve"]
CMD ["/models/model", "--host", "0.0.0.0", "--port", "8080"]
