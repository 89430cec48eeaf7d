# The hub as a container image (for users with Docker; development here runs without it).
FROM rust:1.95-bookworm AS build
RUN apt-get update -qq && apt-get install -y -qq libclang-dev clang libsasl2-dev libzstd-dev libssl-dev pkg-config cmake >/dev/null
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY schemas ./schemas
COPY topology ./topology
RUN cargo build --release --locked

FROM debian:bookworm-slim
RUN apt-get update -qq && apt-get install -y -qq libssl3 libsasl2-2 libzstd1 ca-certificates >/dev/null && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/streaming-hub /usr/local/bin/streaming-hub
COPY topology /etc/streaming-hub/topology
ENV STREAMING_HUB_TOPOLOGY_FILE=/etc/streaming-hub/topology/topics.toml \
    STREAMING_HUB_STATE_DIR=/var/lib/streaming-hub \
    STREAMING_HUB_HTTP_LISTEN_ADDR=0.0.0.0:8080
VOLUME /var/lib/streaming-hub
EXPOSE 8080
ENTRYPOINT ["streaming-hub"]
CMD ["run"]
