# syntax=docker/dockerfile:1
# The engine simulator (vLLM, SGLang and TensorFold HTTP APIs without a GPU), for tests and demos:
# engine-sim --engine vllm serve MODEL --host 0.0.0.0 --port 8000 ...
#
# Build from the repository root (the context is the whole workspace;
# engine-sim.Dockerfile.dockerignore
# beside this file keeps target/ and .git/ out of it; BuildKit is needed, the default since
# Docker 23):
#
#   docker build -f docker/engine-sim.Dockerfile -t capyctl/engine-sim:0.1.0 .
#
# The builder compiles only this binary (cargo build --release --locked -p capyctl-engine-sim
# --bin engine-sim);
# the image holds the binary alone and runs as a non-root user (uid 65532).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p capyctl-engine-sim --bin engine-sim \
    && install -D -m 0755 target/release/engine-sim /out/engine-sim

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/engine-sim /usr/local/bin/engine-sim
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/engine-sim"]
