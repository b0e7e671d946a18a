# syntax=docker/dockerfile:1
#
# palisade container image: the proxy built with the etcd mark store, on a distroless base.
#
#   docker build -t palisade .
#   docker run --rm -p 8080:8080 \
#     -v "$PWD/palisade.toml:/etc/palisade/palisade.toml:ro" \
#     -v palisade-marks:/var/lib/palisade \
#     palisade
#
# The mounted configuration must listen on 0.0.0.0 (`[proxy] listen = "0.0.0.0:8080"`) to be
# reachable from outside the container, and keep a file store's marks under /var/lib/palisade
# (`[marks] path = "/var/lib/palisade/marks.db"`: relative paths resolve against
# /etc/palisade, which the proxy cannot write). The admin listener stays on the container's
# loopback unless the configuration says `[admin] listen = "0.0.0.0:9901"`; the health check
# below works either way.
#
# Needs BuildKit (the default builder since Docker Engine 23; Podman/Buildah understand the
# cache mounts too).

ARG RUST_VERSION=1.95

# ---- build ----------------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-bookworm AS build

# etcd-client's build script compiles etcd's protobuf definitions with protoc. Not pinned: a
# pinned Debian revision stops resolving once the archive moves on; bookworm stays on 3.21.x.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# The whole crate (see .dockerignore): cargo parses every target Cargo.toml declares
# (benches, examples, tests) even when it builds one binary.
COPY . .

# Dependency caching: the crates.io downloads and target/ live in BuildKit cache mounts, so a
# source change recompiles palisade alone, not its dependencies. Cache mounts are not part
# of the image, hence the binary is copied out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --features etcd --bin palisade \
    && install -D -m 0755 target/release/palisade /out/usr/local/bin/palisade \
    && install -d -m 0755 /out/etc/palisade \
    && install -d -m 0750 /out/var/lib/palisade

# ---- runtime --------------------------------------------------------------------------------
# glibc + libgcc (what a Rust binary links), no shell, no package manager. Same Debian release
# (12) as the build stage, so the glibc the binary was linked against is there.
FROM gcr.io/distroless/cc-debian12:nonroot

ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="palisade" \
      org.opencontainers.image.description="Fencing-token reverse proxy: stale owners cannot write" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="MIT OR Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"

COPY --from=build /out/usr/local/bin/palisade /usr/local/bin/palisade
COPY --from=build /out/etc/palisade /etc/palisade
# The marks directory belongs to the runtime user: the file store writes marks.db (and its -wal and -shm), its
# .lock, the /readyz .probe and the audit log there. A named volume mounted here starts with
# this ownership; a host directory must be made writable for 65532 (chown 65532:65532 DIR).
COPY --from=build --chown=65532:65532 /out/var/lib/palisade /var/lib/palisade

# distroless "nonroot": uid 65532, gid 65532. Numeric, so runAsNonRoot can verify it.
USER 65532:65532
WORKDIR /var/lib/palisade
VOLUME ["/etc/palisade", "/var/lib/palisade"]

# 8080: the proxy ([proxy] listen). 9901: the admin listener ([admin] listen), /metrics,
# /livez, /readyz, /marks; published only if the configuration binds it to 0.0.0.0.
EXPOSE 8080 9901

# In-flight requests get [proxy] shutdown_grace_ms (default 10 s) after SIGTERM: give
# `docker stop` more than that (docker stop -t 15, compose stop_grace_period: 15s).
STOPSIGNAL SIGTERM

# No shell or curl in this image: the binary probes its own admin listener (plain HTTP GET,
# exit 0 on a 2xx answer, 1 otherwise). The check runs inside the container, so the
# container's loopback reaches the admin listener whether it binds 127.0.0.1 or 0.0.0.0.
# Change the URL if the configuration moves the admin port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["palisade", "health", "--admin", "127.0.0.1:9901", "--path", "/livez"]

ENTRYPOINT ["palisade"]
CMD ["run", "--config", "/etc/palisade/palisade.toml"]
