# syntax=docker/dockerfile:1
# The command line (capyctl, also kubectl-capyctl): capyctl list deployments, check, start
# standalone, ...
#
# Build from the repository root (the context is the whole workspace;
# capyctl.Dockerfile.dockerignore
# beside this file keeps target/ and .git/ out of it; BuildKit is needed, the default since
# Docker 23):
#
#   docker build -f docker/capyctl.Dockerfile -t capyctl/capyctl:0.1.0 .
#
# The builder compiles only this binary (cargo build --release --locked -p capyctl --bin capyctl);
# the image holds the binary alone and runs as a non-root user (uid 65532).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p capyctl --bin capyctl \
    && install -D -m 0755 target/release/capyctl /out/capyctl

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/capyctl /usr/local/bin/capyctl
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/capyctl"]
