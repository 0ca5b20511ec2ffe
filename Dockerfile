# The argus image used by docker-compose for the worker, the sink and one-shot commands.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY argus ./argus
COPY producers ./producers
COPY streams ./streams
COPY sinks ./sinks
COPY detectors ./detectors
COPY schemas ./schemas
RUN pip install --no-cache-dir .
ENTRYPOINT ["argus"]
