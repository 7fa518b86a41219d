"""The scheduler's per-pod work outside placement, in process and without an API server (issue #39).

A model of what ``gpufrac scheduler`` does for each pod of ``bench/scheduler_e2e.py``'s burst besides
placing it, deterministic enough to count under valgrind's callgrind (whole-run CPU per pod moves with
the shared machine's load more than these paths do): each of N pods of the bench's mix

1. arrives as the API server frames its ADDED watch event, a chunk of a chunked body, one event per
   socket read (the least a read brings), and is read into lines (``kube.lean_http``);
2. is decoded (``kube.stream._watch_event``) and read as the scheduling cycle reads it (``gpu_request``,
   ``pending_pod``);
3. gets its Binding's annotations rendered (``binding_annotations``, on made-up devices) and its target
   built (``LeanHttp._target``, with a client's fieldManager);
4. has the API server's answer to its Binding read (the server's real headers, a ``Status`` by
   ``Content-Length``), and its bound MODIFIED event checked for resize keys (``Resizes.observe``).

It reaches into private functions on purpose, and runs against another tree's ``src`` (PYTHONPATH) to
compare two commits; the digest it prints covers everything read, so two trees that read the same print
the same. SIMULATED: no API server, no sockets (a ``StreamReader`` is fed the bytes).

    .venv/bin/python bench/scheduler_reading.py 600
    nice -n 19 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        bench/scheduler_reading.py 600      # and 100: the difference is pods 101-600
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
from pathlib import Path

import msgspec
from lightkube.resources.core_v1 import Pod

from gpufrac.contract.request import ComputeMode
from gpufrac.kube import lean_http
from gpufrac.kube.stream import _watch_event
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.model import ModePolicy
from gpufrac.scheduler.binder import binding_annotations
from gpufrac.scheduler.objects import gpu_request, pending_pod
from gpufrac.scheduler.resize import Resizes

#: What the API server adds to every pod (admission's default tolerations).
TOLERATIONS = [
    {"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
    for k in ("not-ready", "unreachable")
]
STATUS = b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","code":201}'
#: A Binding's answer with the headers kube-apiserver sends.
ANSWER = (
    b"HTTP/1.1 201 Created\r\nAudit-Id: 5b3c0e8e-3d0c-4f4e-9d6a-0c1f3e2b7a11\r\n"
    b"Cache-Control: no-cache, private\r\nContent-Type: application/json\r\n"
    b"X-Kubernetes-Pf-Flowschema-Uid: 0f9a6c1e-0b6d-4a53-8d1c-2f0c1c9e7d01\r\n"
    b"X-Kubernetes-Pf-Prioritylevel-Uid: 7e1d2c3b-4a5f-4e6d-8c7b-9a0b1c2d3e4f\r\n"
    b"Date: Mon, 07 Dec 2026 01:00:00 GMT\r\nContent-Length: %d\r\n\r\n%s" % (len(STATUS), STATUS)
)


def watch_events(n: int) -> list[bytes]:
    """The bench's first ``n`` pods as ADDED watch events (one JSON line each)."""
    spec = importlib.util.spec_from_file_location(
        "scheduler_e2e", Path(__file__).with_name("scheduler_e2e.py")
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    events = []
    for i in range(n):
        body = bench.pod_manifest(i, namespace="bench", scheduler="gpufrac").to_dict()
        body["metadata"] |= {"uid": f"uid-{i}", "resourceVersion": str(1000 + i)}
        body["spec"]["tolerations"] = TOLERATIONS
        events.append(msgspec.json.encode({"type": "ADDED", "object": body}) + b"\n")
    return events


async def read_lines(events: list[bytes]) -> list[bytes]:
    """The events through a chunked watch body, one per socket read."""
    reader = asyncio.StreamReader(limit=65536)
    arrivals = getattr(lean_http, "_chunked_arrivals", None)
    pieces = (
        arrivals(reader, read_timeout_s=375.0)
        if arrivals is not None
        else lean_http._body_pieces(reader, {"transfer-encoding": "chunked"}, read_timeout_s=375.0)
    )
    lines: list[bytes] = []

    async def consume() -> None:
        pending = b""
        async for data in pieces:
            pending += data
            if b"\n" in data:
                *got, pending = pending.split(b"\n")
                lines.extend(got)

    task = asyncio.create_task(consume())
    for event in events:
        reader.feed_data(b"%x\r\n%s\r\n" % (len(event), event))
        for _ in range(4):
            await asyncio.sleep(0)
    reader.feed_data(b"0\r\n\r\n")
    await task
    return lines


async def model(n: int) -> str:
    digest = hashlib.sha256()
    lines = await read_lines(watch_events(n))
    assert len(lines) == n
    resizes = Resizes.__new__(Resizes)  # its observe() alone: what each bound pod's event asks of it
    resizes._writing, resizes._wanted, resizes._asked, resizes._uncertain = {}, {}, {}, set()
    resizes._wake = asyncio.Event()
    answers = asyncio.StreamReader(limit=65536)
    poster = lean_http.LeanHttp(
        host="127.0.0.1", port=6443, path_prefix="", ssl_context=None, auth=None, timeout_s=5.0
    )
    for line in lines:
        pod = _watch_event(line, Pod).object
        gpu = gpu_request(pod)
        pending = pending_pod(
            pod, gpu=gpu, arrival=1, default_queue="default", mode_policy=ModePolicy.REQUIRED
        )
        sm = ComputeMode.SM_SHARING
        placement = Placement(
            pod_uid=pod.metadata.uid,
            node="n1",
            containers=tuple(
                ContainerPlacement(
                    c.container,
                    c.mode,
                    c.exclusive,
                    tuple(
                        DeviceAssignment(
                            f"GPU-{pod.metadata.uid}-{j}", j, 20480, 40960, 0.25 if c.mode is sm else None
                        )
                        for j in range(c.device_count)
                    ),
                )
                for c in gpu.containers
            ),
        )
        written = binding_annotations(gpu, placement, device_style="uuid")
        target = poster._target(
            f"api/v1/namespaces/bench/pods/{pod.metadata.name}/binding", {"fieldManager": "gpufrac"}
        )
        answers.feed_data(ANSWER)
        answered = await lean_http._read_answer(answers)
        resizes.observe(pod)
        digest.update(
            repr((pending, gpu, sorted(written.items()), target, answered, len(resizes._wanted))).encode()
        )
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pods", type=int, help="how many of the bench's pods")
    print(asyncio.run(model(parser.parse_args().pods)))


if __name__ == "__main__":
    main()
