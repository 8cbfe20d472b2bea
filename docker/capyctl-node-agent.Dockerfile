# syntax=docker/dockerfile:1
# The node agent (host agent, DaemonSet): capyctl-node-agent --file host.yaml [--node-name N]
# [--engine-runtime pod|process]. Built with NVML; libnvidia-ml comes from the node through the
# NVIDIA runtime class at run time (loaded dynamically).
#
# Build from the repository root (the context is the whole workspace;
# capyctl-node-agent.Dockerfile.dockerignore
# beside this file keeps target/ and .git/ out of it; BuildKit is needed, the default since
# Docker 23):
#
#   docker build -f docker/capyctl-node-agent.Dockerfile -t capyctl/capyctl-node-agent:0.1.0 .
#
# The builder compiles only this binary (cargo build --release --locked -p capyctl-node-agent
# --bin capyctl-node-agent --features nvml);
# the image holds the binary alone and runs as a non-root user (uid 65532).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p capyctl-node-agent --bin capyctl-node-agent --features nvml \
    && install -D -m 0755 target/release/capyctl-node-agent /out/capyctl-node-agent

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/capyctl-node-agent /usr/local/bin/capyctl-node-agent
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/capyctl-node-agent"]
