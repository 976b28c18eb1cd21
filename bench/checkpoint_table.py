"""The checkpoint rows of `python -m bench`: one rank's tiers against raw I/O, the peer
tier's copies against raw TCP, and FSDP2 saves and resharded restores. torch is the `torch`
extra: each benchmark is imported only when its rows are built."""

from __future__ import annotations

import statistics

from bench.table import Row, verdict
from resiliency_protocol.checkpoint_reports import Tier

CHECKPOINT_TIER_TARGET = 0.70
CHECKPOINT_BLOCKING_TARGET = 0.10


def checkpoint_rows() -> list[Row]:
    # torch is the `torch` extra: imported only when this part runs.
    from bench import checkpoint

    res = checkpoint.run(checkpoint.CheckpointConfig())
    gb = res.state_bytes / 1e9
    rows = [
        Row(
            f"Checkpoint, {res.params / 1e6:.0f}M params + Adam ({gb:.2f} GB), 1 rank: "
            "blocking per async save (median)",
            f"{statistics.median(res.blocking_s):.3f} s "
            f"= {statistics.median(res.blocking_s) / res.sync_dcp_save_s:.1%} of sync DCP",
            f"sync DCP save {res.sync_dcp_save_s:.2f} s; sync torch.save "
            f"{res.sync_torch_save_s:.2f} s",
            f"<= {CHECKPOINT_BLOCKING_TARGET:.0%} of sync DCP",
            verdict(
                statistics.median(res.blocking_s)
                <= CHECKPOINT_BLOCKING_TARGET * res.sync_dcp_save_s
            ),
        )
    ]
    for key, raw_key in (
        ("ram save", "ram write"),
        ("ram load", "ram read"),
        ("durable save", "durable write"),
        ("durable load", "durable read"),
    ):
        mine, raw = res.tier[key], res.raw[raw_key]
        rows.append(
            Row(
                f"  {key} (MiB/s)",
                f"{mine:,.0f} MiB/s = {mine / raw:.0%} of raw",
                f"raw {raw_key}: {raw:,.0f} MiB/s",
                f">= {CHECKPOINT_TIER_TARGET:.0%} of raw",
                verdict(mine >= CHECKPOINT_TIER_TARGET * raw),
            )
        )
    rows.append(
        Row(
            "  ram save, with the copy to host memory before it (MiB/s)",
            f"{res.tier['ram save with staging']:,.0f}",
        )
    )
    durable_load = res.tier["durable load"]
    if res.peer_load is not None and res.peer_push is not None:
        rows += [
            Row(
                "  swapped-in spare: restore from the partner's copy (MiB/s)",
                f"{res.peer_load:,.0f} MiB/s = {res.peer_load / durable_load:.1f}x durable",
                f"restore from durable: {durable_load:,.0f} MiB/s",
                "faster than durable",
                verdict(res.peer_load > durable_load),
            ),
            Row("  peer copy, host monitor to host monitor (MiB/s)", f"{res.peer_push:,.0f}"),
        ]
    else:
        rows.append(Row("  peer restore", res.peer_error or "not measured", verdict="FAIL"))
    return rows + peer_transfer_rows() + sharded_checkpoint_rows()


PEER_TRANSFER_TARGET = 0.70


def peer_transfer_rows() -> list[Row]:
    """The peer tier's copies against raw loopback TCP, alternating, several rounds."""
    from bench import peer_transfer

    cfg = peer_transfer.PeerTransferConfig()
    res = peer_transfer.run(cfg)
    if res.error is not None or "raw" not in res.rates:
        return [Row("  peer transfers", res.error or "not measured", verdict="FAIL")]
    raw = res.median("raw")
    streams = f"{cfg.files} streams"
    gib = res.nbytes / 2**30
    rows = [
        Row(
            f"Peer tier data plane, {gib:.1f} GiB in {cfg.files} files, median of "
            f"{cfg.rounds} rounds: raw loopback TCP (MiB/s)",
            f"{raw:,.0f}",
            f"{streams}, sendfile from tmpfs into recv_into, written to tmpfs; rounds "
            + ", ".join(f"{r:,.0f}" for r in res.rates["raw"]),
        )
    ]
    for key, what in (
        ("push", "copy host monitor to host monitor"),
        ("fetch", "partner's copy into a spare rank's RAM tier, relayed"),
    ):
        mine = res.median(key)
        rows.append(
            Row(
                f"  {what} (MiB/s)",
                f"{mine:,.0f} MiB/s = {mine / raw:.0%} of raw",
                f"raw {raw:,.0f} MiB/s; rounds " + ", ".join(f"{r:,.0f}" for r in res.rates[key]),
                f">= {PEER_TRANSFER_TARGET:.0%} of raw",
                verdict(mine >= PEER_TRANSFER_TARGET * raw),
            )
        )
    if "bucket" in res.rates:
        fetch, bucket = res.median("fetch"), res.median("bucket")
        rows.append(
            Row(
                "  a swapped-in spare's restore: partner's copy vs object store (MiB/s)",
                f"peer {fetch:,.0f} MiB/s = {fetch / bucket:.1f}x the bucket's",
                "the same step from SeaweedFS's S3 server on loopback through the durable "
                "tier's restore, in the same rounds; rounds "
                + ", ".join(f"{r:,.0f}" for r in res.rates["bucket"]),
                "peer faster than the bucket",
                verdict(fetch > bucket),
            )
        )
    for suffix, label in (("", ""), (" tls", " (TLS)")):
        if f"push sender{suffix}" not in res.cpu:
            continue
        c = res.cpu_median
        rows.append(
            Row(
                f"  host monitors' CPU seconds per GiB moved{label}",
                f"push: sender {c('push sender' + suffix):.2f}, receiver "
                f"{c('push receiver' + suffix):.2f}; fetch: sender "
                f"{c('fetch sender' + suffix):.2f}, relay {c('fetch relay' + suffix):.2f}, "
                f"rank {c('fetch receiver' + suffix):.2f}",
                f"raw TCP: sender {c('raw sender' + suffix):.2f}, receiver "
                f"{c('raw receiver' + suffix):.2f}",
            )
        )
    if "raw tls" in res.rates:
        raw_tls = res.median("raw tls")
        push, fetch = res.median("push tls"), res.median("fetch tls")
        rows.append(
            Row(
                "  with TLS on: push, fetch (MiB/s)",
                f"{push:,.0f} ({push / raw_tls:.0%} of raw TLS, {push / res.median('push'):.0%}"
                f" of plain), {fetch:,.0f} ({fetch / raw_tls:.0%}, "
                f"{fetch / res.median('fetch'):.0%})",
                f"raw TLS loopback {raw_tls:,.0f} MiB/s ({raw_tls / raw:.0%} of plain)",
            )
        )
    else:
        rows.append(Row("  with TLS on", "not measured (trustme is not installed)"))
    return rows


RESHARDED_RESTORE_TARGET = 1.5


def sharded_checkpoint_rows() -> list[Row]:
    from bench import sharded_checkpoint

    cfg = sharded_checkpoint.ShardedConfig()
    res = sharded_checkpoint.run(cfg)
    gb = res.state_bytes / 1e9
    blocking = statistics.median(res.blocking_s)
    ratio = res.resharded_restore_s / res.same_layout_restore_s
    return [
        Row(
            f"Checkpoint, FSDP2 {cfg.world} ranks, {res.params / 1e6:.0f}M params + Adam "
            f"({gb:.2f} GB): blocking per async save (median, slowest rank)",
            f"{blocking:.3f} s = {blocking / res.sync_dcp_save_s:.1%} of sync DCP",
            f"sync collective DCP save {res.sync_dcp_save_s:.2f} s",
            f"<= {CHECKPOINT_BLOCKING_TARGET:.0%} of sync DCP",
            verdict(blocking <= CHECKPOINT_BLOCKING_TARGET * res.sync_dcp_save_s),
        ),
        Row(
            "  step time with a RAM save every step (FSDP without replicas: 1 step lost)",
            f"{res.step_with_ram_save_s:.3f} s = "
            f"{res.step_with_ram_save_s / res.step_s - 1:+.0%} per step",
            f"without checkpoints {res.step_s:.3f} s",
        ),
        Row("  ram save, summed over ranks (MiB/s)", f"{res.save_mib_s[Tier.RAM]:,.0f}"),
        Row("  durable save, summed over ranks (MiB/s)", f"{res.save_mib_s[Tier.DURABLE]:,.0f}"),
        Row("  ram load, same layout (MiB/s)", f"{res.ram_load_mib_s:,.0f}"),
        Row("  durable load, same layout (MiB/s)", f"{res.durable_load_mib_s:,.0f}"),
        Row(
            f"  restore resharded {cfg.world} -> {cfg.resharded_world} ranks (durable)",
            f"{res.resharded_restore_s:.2f} s = {ratio:.2f}x same layout",
            f"same-layout restore from durable {res.same_layout_restore_s:.2f} s",
            f"<= {RESHARDED_RESTORE_TARGET:g}x",
            verdict(ratio <= RESHARDED_RESTORE_TARGET and res.resharded_tier == Tier.DURABLE),
        ),
    ]
