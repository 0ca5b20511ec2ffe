# The argus image used by docker-compose for the worker, the sink and one-shot commands: the server extra at
# the exact versions CI tests (constraints.txt).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY argus ./argus
RUN pip install --no-cache-dir -c constraints.txt ".[server]"
# The diagnosis kernels compiled into the image, so a worker's first windows do not wait for numba.
RUN python -m argus.warmup
ENTRYPOINT ["argus"]
