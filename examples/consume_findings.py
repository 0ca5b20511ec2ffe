"""Page the on-call channel for argus findings that cost a job more than a threshold of GPU time.

Reads the JSON findings topic with plain confluent-kafka (no argus code): one JSON object per message, the
`argus findings --json` contract. Run:  python examples/consume_findings.py --min-gpu-s 60
"""

import argparse
import json

from confluent_kafka import Consumer

ap = argparse.ArgumentParser()
ap.add_argument("--bootstrap", default="127.0.0.1:19092")
ap.add_argument("--topic", default="argus.findings.json")
ap.add_argument("--min-gpu-s", type=float, default=60.0, help="page for findings costing more GPU-seconds")
ap.add_argument("--from-beginning", action="store_true", help="read the retained findings too, not only new ones")
ap.add_argument("--max-messages", type=int, default=0, help="stop after this many messages (0: never)")
args = ap.parse_args()

consumer = Consumer({"bootstrap.servers": args.bootstrap, "group.id": "argus-pager",
                     "auto.offset.reset": "earliest" if args.from_beginning else "latest"})
consumer.subscribe([args.topic])
seen, read = set(), 0
try:
    while not args.max_messages or read < args.max_messages:
        msg = consumer.poll(1.0)
        if msg is None or msg.error():
            continue
        read += 1
        f = json.loads(msg.value())
        key = (f["job"], f["level"], f["kind"], tuple(f["ranks"]), f["phase"], f["kernel"], tuple(f["steps"]))
        if f["impact_ns"] / 1e9 >= args.min_gpu_s and key not in seen:  # at-least-once: copies are possible
            seen.add(key)
            where = f["phase"] or f["kernel"] or "job-wide"
            print(f"PAGE job={f['job']} {f['level']} {f['kind']} ranks={f['ranks'] or '-'} {where} "
                  f"lost {f['impact_ns'] / 1e9:.0f} GPU-s (score {f['score']:.2f})", flush=True)
finally:
    consumer.close()
