# syntax=docker/dockerfile:1
# The operator (the server on Kubernetes): capyctl-operator [--file server.yaml] [--set ...].
#
# Build from the repository root (the context is the whole workspace;
# capyctl-operator.Dockerfile.dockerignore
# beside this file keeps target/ and .git/ out of it; BuildKit is needed, the default since
# Docker 23):
#
#   docker build -f docker/capyctl-operator.Dockerfile -t capyctl/capyctl-operator:0.1.0 .
#
# The builder compiles only this binary (cargo build --release --locked -p capyctl-operator --bin
# capyctl-operator);
# the image holds the binary alone and runs as a non-root user (uid 65532).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p capyctl-operator --bin capyctl-operator \
    && install -D -m 0755 target/release/capyctl-operator /out/capyctl-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/capyctl-operator /usr/local/bin/capyctl-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/capyctl-operator"]
