"""The mapping store on disk: atomic records that survive the agent, and Synchronize's replace_all."""

from __future__ import annotations

import json
from pathlib import Path

from gpufrac.node.mapping import SCHEMA_VERSION, AllocationRecord, MappingStore


def record(container_id: str, *, limit_mib: int = 2048) -> AllocationRecord:
    return AllocationRecord(
        container_id=container_id,
        pod_namespace="ml",
        pod_name="p",
        pod_uid="uid-1",
        container_name="c",
        devices=("GPU-a", "GPU-b"),
        request_mib=1024,
        limit_mib=limit_mib,
        mode="sm-sharing",
        portion=0.25,
        pipe_dir=f"/run/gpufrac/mps-pipes/{container_id}",
    )


def test_a_record_is_one_schema_versioned_file_that_a_new_store_reads_back(tmp_path: Path) -> None:
    store = MappingStore(directory=tmp_path)
    store.put(record("c1"))
    store.flush()
    on_disk = json.loads((tmp_path / "containers" / "c1.json").read_text())
    assert on_disk["schema"] == SCHEMA_VERSION
    assert on_disk["devices"] == ["GPU-a", "GPU-b"] and on_disk["limit_mib"] == 2048
    assert [p.name for p in (tmp_path / "containers").iterdir()] == ["c1.json"]  # no temporary left behind

    again = MappingStore(directory=tmp_path)
    assert again.get("c1") == store.get("c1")


def test_unreadable_and_future_schema_records_are_skipped_not_fatal(tmp_path: Path) -> None:
    first = MappingStore(directory=tmp_path)
    first.put(record("good"))
    first.flush()
    (tmp_path / "containers" / "torn.json").write_text('{"schema": 1, "container_')
    future = record("future").to_json() | {"schema": SCHEMA_VERSION + 1}
    (tmp_path / "containers" / "future.json").write_text(json.dumps(future))
    store = MappingStore(directory=tmp_path)
    assert [r.container_id for r in store.allocations()] == ["good"]
    assert (tmp_path / "containers" / "future.json").exists()  # left for the agent that understands it


def test_replace_all_makes_the_store_equal_to_what_the_runtime_reports(tmp_path: Path) -> None:
    store = MappingStore(directory=tmp_path)
    store.put(record("stay"))
    store.put(record("gone"))
    created_at = store.get("stay").created_at  # type: ignore[union-attr]

    written, removed = store.replace_all([record("stay"), record("new", limit_mib=4096)])
    store.flush()
    assert (written, removed) == (1, 1)
    assert sorted(r.container_id for r in store.allocations()) == ["new", "stay"]
    assert store.get("stay").created_at == created_at  # type: ignore[union-attr]
    assert sorted(p.name for p in (tmp_path / "containers").iterdir()) == ["new.json", "stay.json"]
    assert store.replace_all([record("stay"), record("new", limit_mib=4096)]) == (0, 0)


def test_remove_is_idempotent(tmp_path: Path) -> None:
    store = MappingStore(directory=tmp_path)
    store.put(record("c1"))
    assert store.remove("c1") is not None
    assert store.remove("c1") is None
    store.close()
    assert store.allocations() == [] and list((tmp_path / "containers").iterdir()) == []


def test_readers_see_a_put_at_once_and_the_disk_in_order(tmp_path: Path) -> None:
    store = MappingStore(directory=tmp_path)
    for limit in (1024, 2048, 3072):
        store.put(record("c1", limit_mib=limit))
        assert store.get("c1").limit_mib == limit  # type: ignore[union-attr]
    store.flush()
    assert json.loads((tmp_path / "containers" / "c1.json").read_text())["limit_mib"] == 3072
