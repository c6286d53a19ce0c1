#!/usr/bin/env python3
"""Serves a Kev checkpoint on Ray Serve, with requests routed by their state.

Each replica holds one `kev.DecisionModel` and one `kev.PrefixCache`, and scores what Ray Serve's
batching gathers in one `probs_cached` call: a state whose prefix the replica holds does not run
again. A prefix cache is per process, so replicas chosen regardless of the state split each
state's requests across caches; here a request goes to the replica its state maps to:

- **Routing** (`StateRouter`, a Ray Serve request router): the replicas are ranked for each
  request by rendezvous hashing of its state text (each state its own order of the replicas;
  a replica that leaves moves only its own states). The first takes the request unless it is
  at `max_ongoing_requests`, then the next: a hot state spills to a second replica instead of
  queueing behind one (a bounded load). `--routing round-robin` (`RoundRobinRouter`) ignores the
  state, for comparison.
- **HTTP**: `POST /v1/score` with one record answers what `kev-serve` and `score` answer for it
  (`{"id", "questions": [{"id", "probs", "argmax", "option"}]}`; the probabilities are the same
  f32 values, written as Python floats), 422 with the library's message for an invalid record,
  400 for a body that is not JSON; the header `x-kev-replica` names the replica. `GET /v1/cache`
  sums the replicas' cache counters as last reported.

    python examples/ray_serve.py --replicas 2                     # serve on :8000 until Ctrl-C
    python examples/ray_serve.py bench --replicas 1 2 --routing state round-robin

`bench` runs the shared-state workload (REQUESTS records over STATES states, one question each,
states drawn at random, CLIENTS at once) against each configuration in turn and prints one JSON
line each: records/s, the cache hit rate and the requests and states each replica took. The
replicas share `--cache-states` states' worth of prefix bytes (split evenly), so every
configuration has the same memory for prefixes. The default, 1.6 x STATES, leaves each of two
replicas room for the states hashing gives it (a binomial split: 20 states put more than 16 on
one replica about once in 400 runs), so routing by state loses no hits to a cache too small for
its share. `--answers FILE` adds each configuration's answers to the records of
FILE (status and body), in order.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

import kev

ROOT = Path(__file__).resolve().parents[1]


def state_key(pending: Optional[PendingRequest]) -> Optional[bytes]:
    """The routing key a request carries: the first argument of `KevReplica.score` is
    `(key, record text)`."""
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    return arg[0] if isinstance(arg, tuple) and arg and isinstance(arg[0], bytes) else None


class RankedRouter(RequestRouter):
    """A router whose `order` puts the replicas in the order to try them, one a rank: the first
    takes the request unless it is full, then the next. `None`: no order, the least loaded."""

    def order(self, replicas: List[RunningReplica],
              pending: Optional[PendingRequest]) -> Optional[List[RunningReplica]]:
        raise NotImplementedError

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Every rank tried and full: back off before the next round (else it loops probing).
            pending_request.routing_context.should_backoff = True
        ordered = self.order(candidate_replicas, pending_request)
        if ordered is None:
            return [candidate_replicas]
        ranks = [[r] for r in ordered]
        if pending_request is None:
            return ranks
        # A replica slow to answer Ray's queue-length probe (0.1 s at first) is not a full one:
        # the first round asks the first replica alone; later rounds, after a back-off and with
        # longer probe deadlines, go down the order.
        context = pending_request.routing_context
        first = not getattr(context, "kev_asked", False)
        context.kev_asked = True
        return ranks[:1] if first else ranks


class StateRouter(RankedRouter):
    """Replicas ranked by rendezvous hashing of the request's state key."""

    def order(self, replicas, pending):
        key = state_key(pending)
        if key is None:
            return None

        def weight(r: RunningReplica) -> bytes:
            return hashlib.blake2b(key + r.replica_id.unique_id.encode(), digest_size=8).digest()

        return sorted(replicas, key=weight, reverse=True)


class RoundRobinRouter(RankedRouter):
    """Replicas in turn, whatever the state (the comparison `bench` makes)."""

    turn = 0

    def order(self, replicas, pending):
        ranked = sorted(replicas, key=lambda r: r.replica_id.unique_id)
        start = self.turn % len(ranked)
        self.turn += 1
        return ranked[start:] + ranked[:start]


ROUTERS = {"state": StateRouter, "round-robin": RoundRobinRouter}


def answer(record: Dict[str, Any], probs: List[np.ndarray]) -> Dict[str, Any]:
    """`score`'s line for a record: per question its id, probabilities (the f32 values), argmax
    (the first largest) and that option."""
    questions = []
    for q, p in zip(record["questions"], probs):
        k = int(np.argmax(p))
        questions.append({"id": q.get("id"), "probs": [float(x) for x in p], "argmax": k,
                          "option": q["options"][k]})
    return {"id": record.get("id"), "questions": questions}


class KevReplica:
    """One model and its prefix cache; concurrent requests scored as one batch."""

    def __init__(self, checkpoint: str, backend: str, dtype: str, cache_bytes: int):
        self.model = kev.DecisionModel.load(checkpoint, backend=backend, dtype=dtype)
        self.cache = kev.PrefixCache(cache_bytes)
        self.name = serve.get_replica_context().replica_id.unique_id

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def score(self, requests: List[Tuple[bytes, str]]) -> List[Dict[str, Any]]:
        texts = [text for _, text in requests]
        try:
            probs = await asyncio.to_thread(self.model.probs_cached, texts, self.cache)
            results = [{"answer": answer(json.loads(t), p)} for t, p in zip(texts, probs)]
        except kev.KevError:
            # Some record is invalid: each alone, so the others are answered and it gets its error
            # (the others run again: a batch with an invalid record is the rare case).
            results = [await asyncio.to_thread(self._one, t) for t in texts]
        stats = self.cache.stats()
        for r in results:
            r["replica"], r["cache"] = self.name, stats
        return results

    def _one(self, text: str) -> Dict[str, Any]:
        try:
            return {"answer": answer(json.loads(text), self.model.probs_cached([text], self.cache)[0])}
        except kev.RecordError as e:  # TooLongError included: the client's record, as kev-serve
            return {"error": str(e), "code": 422}
        except kev.KevError as e:  # the model's or the device's fault, not the client's
            return {"error": str(e), "code": 500}


class Ingress:
    """HTTP in front of the replicas: parses the body once for the state, routes by it."""

    def __init__(self, replicas):
        self.replicas = replicas
        self.cache: Dict[str, Dict[str, int]] = {}

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        if request.url.path.rstrip("/").endswith("/v1/cache"):
            total = {k: sum(s[k] for s in self.cache.values()) for k in ("hits", "misses", "entries", "bytes")}
            return JSONResponse({**total, "replicas": len(self.cache)})
        if request.method != "POST":
            return JSONResponse({"error": {"code": 405, "message": "POST a record"}}, status_code=405)
        body = await request.body()
        try:
            text = body.decode("utf-8")
            state = json.loads(text).get("state")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            return JSONResponse({"error": {"code": 400, "message": f"not a JSON record: {e}"}}, status_code=400)
        # surrogatepass: a lone surrogate (valid JSON escape, not UTF-8) still routes; the
        # replica refuses it with the library's message.
        key = hashlib.blake2b(str(state).encode("utf-8", "surrogatepass"), digest_size=16).digest()
        result = await self.replicas.score.remote((key, text))
        self.cache[result["replica"]] = result["cache"]
        headers = {"x-kev-replica": result["replica"]}
        if "error" in result:
            code = result["code"]
            return JSONResponse({"error": {"code": code, "message": result["error"]}},
                                status_code=code, headers=headers)
        return JSONResponse(result["answer"], headers=headers)


def app(checkpoint: str, replicas: int, routing: str, cache_bytes: int, backend: str = "auto",
        dtype: str = "auto", cpus_per_replica: float = 1.0, max_ongoing: int = 32):
    """The Serve application: `replicas` Kev replicas behind one ingress."""
    replica = serve.deployment(
        KevReplica,
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": cpus_per_replica},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[routing]),
    ).bind(checkpoint, backend, dtype, cache_bytes // replicas)
    return serve.deployment(Ingress, ray_actor_options={"num_cpus": 0}).bind(replica)


def shared_workload(requests: int, states: int, seed: int = 0) -> List[Dict[str, Any]]:
    """REQUESTS one-question records over STATES states of ~100 words, states drawn at random."""
    words = ["market", "price", "rain", "river", "north", "signal", "volume", "risk", "order",
             "city", "morning", "trade", "cloud", "bridge", "yield", "storm"]
    texts = [" ".join(words[(s * 7 + w * 3 + w // 5) % len(words)] for w in range(100)) + f" (case {s})"
             for s in range(states)]
    rng = random.Random(seed)
    return [{"id": f"req{i}", "state": rng.choice(texts),
             "questions": [{"prompt": f"Question {i % 7}: what next?",
                            "options": ["buy", "sell", "hold", f"wait {i % 5}"]}]}
            for i in range(requests)]


def post(url: str, record: Any) -> Tuple[int, Dict[str, Any]]:
    body = record if isinstance(record, bytes) else json.dumps(record).encode("utf-8")
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> Dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def prefix_bytes(checkpoint: str, backend: str, dtype: str, records: List[Dict[str, Any]]) -> float:
    """Mean bytes of one state's prefix on this machine's model."""
    model = kev.DecisionModel.load(checkpoint, backend=backend, dtype=dtype)
    cache = kev.PrefixCache(1 << 40)
    seen = {r["state"]: r for r in records}
    model.probs_cached(list(seen.values()), cache)
    s = cache.stats()
    return s["bytes"] / max(s["entries"], 1)


def bench(args) -> int:
    records = shared_workload(args.requests, args.states)
    if args.cache_states is None:
        args.cache_states = 1.6 * args.states
    cache_bytes = int(args.cache_states * prefix_bytes(args.checkpoint, args.backend, args.dtype, records))
    base = f"http://127.0.0.1:{args.port}"
    for replicas, routing in itertools.product(args.replicas, args.routing):
        if replicas == 1 and routing != args.routing[0]:
            continue  # one replica: routing makes no difference
        serve.run(app(args.checkpoint, replicas, routing, cache_bytes, args.backend, args.dtype,
                      args.cpus_per_replica), name="kev", route_prefix="/")
        # Warm each replica's model outside the timed part: one request per state would fill
        # caches, so a record of a state outside the workload.
        for i in range(4 * replicas):
            post(f"{base}/v1/score", {"state": f"warm-up {i}", "questions": [{"prompt": "q", "options": ["a", "b"]}]})
        before = get(f"{base}/v1/cache")
        taken: Dict[str, int] = {}
        states_of: Dict[str, set] = {}
        lock = threading.Lock()

        def one(r):
            req = urllib.request.Request(f"{base}/v1/score", data=json.dumps(r).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
                with lock:
                    name = resp.headers["x-kev-replica"]
                    taken[name] = taken.get(name, 0) + 1
                    states_of.setdefault(name, set()).add(r["state"])

        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(one, records))
        took = time.perf_counter() - start
        after = get(f"{base}/v1/cache")
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        line = {"replicas": replicas, "routing": routing, "requests": len(records), "states": args.states,
                "clients": args.clients, "cache_states": args.cache_states, "cache_bytes": cache_bytes,
                "records_per_s": round(len(records) / took, 1), "hit_rate": round(hits / max(hits + misses, 1), 4),
                "hits": hits, "misses": misses, "per_replica": sorted(taken.values(), reverse=True),
                "states_per_replica": sorted((len(v) for v in states_of.values()), reverse=True)}
        if args.answers:
            lines = Path(args.answers).read_text(encoding="utf-8").splitlines()
            line["answers"] = [post(f"{base}/v1/score", l.encode("utf-8")) for l in lines]
        print(json.dumps(line), flush=True)
        serve.delete("kev")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    benching = bool(argv) and argv[0] == "bench"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(ROOT / "tests/fixtures/kev-small"),
                   help="checkpoint folder (holding kev.json), on every node (default: the shipped small one)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="Ray cluster address (default: a local one)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    if benching:
        p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
        p.add_argument("--routing", nargs="+", choices=sorted(ROUTERS), default=["state", "round-robin"])
        p.add_argument("--requests", type=int, default=2000)
        p.add_argument("--states", type=int, default=50)
        p.add_argument("--clients", type=int, default=16)
        p.add_argument("--answers", default=None, help="JSONL records whose answers to add")
        p.add_argument("--cache-states", type=float, default=None,
                       help="prefix cache of all replicas together, in prefixes of the workload's "
                            "states (default: 1.6 x STATES, room for every state of an uneven split)")
        argv = argv[1:]
    else:
        p.add_argument("--replicas", type=int, default=1)
        p.add_argument("--routing", choices=sorted(ROUTERS), default="state")
        p.add_argument("--cache-mib", type=int, default=1024, help="prefix cache of all replicas together")
    args = p.parse_args(argv)
    ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    if benching:
        return bench(args)
    serve.run(app(args.checkpoint, args.replicas, args.routing, args.cache_mib << 20, args.backend,
                  args.dtype, args.cpus_per_replica), name="kev", route_prefix="/")
    print(f"serving on http://127.0.0.1:{args.port}/v1/score (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
