# A stand-in for python:3.11-slim, built from a local debootstrap image (see base-image.sh).
# Debian bookworm's python3 is 3.11; a venv on PATH makes `python` and `pip install` behave as in the official image.
ARG DEBIAN_IMAGE=ddp-course/debian:bookworm
FROM ${DEBIAN_IMAGE}

ENV LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /usr/local/python \
    && /usr/local/python/bin/pip install --no-cache-dir --upgrade pip

ENV PATH=/usr/local/python/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt

CMD ["python3"]
