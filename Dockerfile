# The platform's image: web (Daphne), Celery workers and beat all run from it.
#
#   docker build -t clawplatform .                                   # CPU torch (web, worker)
#   docker build -t clawplatform-gpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch (worker-train)
#
# TORCH_INDEX_URL picks the PyTorch wheel index: .../whl/cpu (default, small) or a CUDA one
# (.../whl/cu126, .../whl/cu128, ...) matching the host's NVIDIA driver. constraints.txt pins
# torch==2.13.0, which both 2.13.0+cpu and 2.13.0+cuXXX satisfy.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=clawplatform.settings.production \
    DATA_DIR=/data \
    ADAPTER_ROOT=/data/adapters \
    HF_HOME=/data/hf

RUN useradd --create-home --uid 1000 claw \
    && mkdir -p /data/adapters /data/hf \
    && chown -R claw:claw /data

WORKDIR /app

# Dependencies first, against empty package stubs, so that a code change does not reinstall torch.
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir -p clawplatform chat training serving \
    && touch clawplatform/__init__.py chat/__init__.py training/__init__.py serving/__init__.py \
    && pip install --extra-index-url "${TORCH_INDEX_URL}" -c constraints.txt -e . \
    && rm -rf clawplatform chat training serving

COPY --chown=claw:claw . .

USER claw
EXPOSE 8000
VOLUME ["/data"]

CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "--websocket_connect_timeout", "30", "clawplatform.asgi:application"]
