"""The S3 backend against a real S3 server (moto's, on loopback) and faults in front of it.

The conformance suite (test_storage.py) runs against it too; here: multipart streams with
bounded buffers, the conditional manifest put, a step written and restored through the
engine, and the faults: throttling and 5xx answered by a proxy, a slow server, the server
killed mid-upload, and the one-line errors (missing bucket, refused credentials,
unreachable endpoint, no boto3). After every failed upload no multipart upload is left.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass

import pytest
import torch
from _s3_server import CREDENTIALS, FaultProxy, MotoServer, client, new_bucket, running_moto

from stalwart.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    PersistConfig,
    committed_steps,
    open_storage,
    restore_state,
    verify_step,
)
from stalwart.checkpoint.storage import S3Config, S3Storage
from stalwart.cli.main import main
from stalwart.errors import ConfigError, StepCommittedError, StorageUnavailableError

MIB = 1 << 20
PART = 5 * MIB  # S3's minimum part size: several parts from a small object


@dataclass
class Bucket:
    server: MotoServer
    name: str

    def storage(self, endpoint: str | None = None, **kw: int) -> S3Storage:
        config = S3Config(endpoint_url=endpoint or self.server.url, part_bytes=PART, **kw)
        return S3Storage(f"s3://{self.name}/ck", config)

    def uploads(self) -> list[object]:
        reply = client(self.server.url).list_multipart_uploads(Bucket=self.name)
        return list(reply.get("Uploads", []))


@pytest.fixture
def bucket(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    return Bucket(moto, new_bucket(moto.url))


def _payload(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


def _write(storage: S3Storage, path: str, data: bytes, piece: int = 3 * MIB + 7) -> None:
    stream = storage.open_stream(path)
    view = memoryview(data)
    for at in range(0, len(data), piece):
        stream.write(view[at : at + piece])
    stream.commit()


def test_multipart_stream_bounded_and_whole(bucket: Bucket) -> None:
    st = bucket.storage(parallel_parts=2)
    data = _payload(4 * PART + 12345)  # 5 parts, the last one short
    stream = st.open_stream("data/p.pack")
    view = memoryview(data)
    for at in range(0, len(data), 3 * MIB + 7):
        stream.write(view[at : at + 3 * MIB + 7])
    assert not st.exists("data/p.pack")  # invisible until completed
    stream.commit()
    assert st.read("data/p.pack") == data
    assert stream.buffers_allocated <= 2 + 1  # parallel_parts + the one being filled
    assert bucket.uploads() == []


def test_manifest_put_is_conditional(bucket: Bucket) -> None:
    st = bucket.storage()
    st.write_atomic("step_000000000001/MANIFEST.json", b"{}")
    with pytest.raises(StepCommittedError, match="already exists"):
        st.write_atomic("step_000000000001/MANIFEST.json", b"{}")
    st.write_atomic("step_000000000001/other.json", b"1")
    st.write_atomic("step_000000000001/other.json", b"2")  # any other file: overwritten
    assert st.read("step_000000000001/other.json") == b"2"


def test_engine_save_verify_restore(
    bucket: Bucket, shm_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the persister process: the endpoint reaches it the way it reaches a job's
    workers, in boto3's own environment variable."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.server.url)
    url = f"s3://{bucket.name}/run"
    mgr = CheckpointManager(CheckpointConfig(url, namespace=shm_namespace))
    state = {"w": torch.arange(3 * MIB, dtype=torch.float32), "b": torch.ones(7)}
    try:
        mgr.save(state, 5)
        state["b"] += 1
        mgr.save(state, 6)  # incremental: w's chunks are not uploaded again
        target = {"w": torch.empty(3 * MIB), "b": torch.empty(7)}
        assert mgr.restore(target).step == 6
    finally:
        mgr.close()
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    st = open_storage(url)
    assert committed_steps(st) == [5, 6]
    assert verify_step(st, 5).ok and verify_step(st, 6).ok
    assert bucket.uploads() == []


def test_throttling_is_retried(bucket: Bucket) -> None:
    with FaultProxy(bucket.server.port) as proxy:
        st = bucket.storage(proxy.url)
        proxy.slowdown = 3  # the next three requests: 503 SlowDown
        data = _payload(2 * PART + 1)
        _write(st, "a.bin", data)
        assert proxy.answered.get(503) == 3
        assert st.read("a.bin") == data


def test_failed_upload_is_aborted(bucket: Bucket) -> None:
    """Every try of part 2 gets 500: the stream fails with one line and the multipart
    upload is aborted on the store (none left to list)."""
    with FaultProxy(bucket.server.port) as proxy:
        st = bucket.storage(proxy.url, max_attempts=2)
        proxy.fail = lambda method, path: (500, "InternalError") if "partNumber=2" in path else None
        with pytest.raises(StorageUnavailableError, match="InternalError") as err:
            _write(st, "b.bin", _payload(3 * PART))
        assert "\n" not in str(err.value)
        assert proxy.seen.get("PUT part", 0) >= 2
        assert bucket.uploads() == []
        assert not st.exists("b.bin")


def test_slow_server(bucket: Bucket) -> None:
    with FaultProxy(bucket.server.port) as proxy:
        proxy.delay_s = 0.2
        st = bucket.storage(proxy.url)
        data = _payload(2 * PART + 99)
        _write(st, "slow.bin", data)
        assert st.read("slow.bin") == data


def test_server_killed_mid_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own server (the session's one survives): killed once part 1 reached it."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    with running_moto() as server:
        name = new_bucket(server.url)
        with FaultProxy(server.port) as proxy:
            st = S3Storage(
                f"s3://{name}/ck",
                S3Config(endpoint_url=proxy.url, part_bytes=PART, max_attempts=2),
            )
            stream = st.open_stream("k.pack")
            stream.write(_payload(PART))  # part 1 goes to the pool
            proxy.wait_for("PUT part", 1)
            server.kill()
            with pytest.raises(StorageUnavailableError) as err:
                stream.write(_payload(2 * PART))
                stream.commit()
            assert "\n" not in str(err.value)
            with pytest.raises(StorageUnavailableError):
                st.listdir("")


def test_missing_bucket(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    st = S3Storage("s3://no-such-bucket-here/x", S3Config(endpoint_url=moto.url))
    with pytest.raises(StorageUnavailableError, match="does not exist: create it"):
        st.listdir("")


def test_refused_credentials(bucket: Bucket) -> None:
    with FaultProxy(bucket.server.port) as proxy:
        proxy.fail = lambda method, path: (403, "InvalidAccessKeyId")
        st = bucket.storage(proxy.url)
        with pytest.raises(StorageUnavailableError, match="refused the credentials"):
            st.write_atomic("x", b"1")


def test_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    st = S3Storage("s3://b/x", S3Config(endpoint_url="http://127.0.0.1:9", max_attempts=1))
    with pytest.raises(StorageUnavailableError, match="cannot reach the S3 endpoint"):
        st.read("anything")


def test_no_boto3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(ConfigError, match=r"needs boto3: pip install 'stalwart\[s3\]'"):
        S3Storage("s3://b/x")


def test_url_and_config_checked() -> None:
    with pytest.raises(ConfigError):
        S3Storage("s3:///x")
    with pytest.raises(ConfigError):
        S3Storage("s3://b/../x")
    with pytest.raises(ConfigError, match="5 MiB"):
        S3Config(part_bytes=MIB)


def test_parallel_streams_share_a_storage(bucket: Bucket) -> None:
    """Ranks' persisters each stream their own pack through one client."""
    st = bucket.storage()
    datas = {f"p{i}": _payload(PART + 1000 * i) for i in range(3)}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            _write(st, name, datas[name])
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(n,)) for n in datas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {n: st.read(n) for n in datas} == datas
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"


def test_cli_ls_verify_and_one_line_errors(
    bucket: Bucket,
    shm_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"s3://{bucket.name}/cli"
    endpoint = bucket.server.url
    mgr = CheckpointManager(CheckpointConfig(url, namespace=shm_namespace, s3=S3Config(endpoint)))
    try:
        mgr.save({"w": torch.ones(1000)}, 3)
    finally:
        mgr.close()
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    assert main(["ckpt", "ls", url, "--s3-endpoint", endpoint, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["checkpoints"]] == [3]
    assert main(["ckpt", "verify", url, "--s3-endpoint", endpoint]) == 0
    assert "step 3: ok" in capsys.readouterr().out
    assert main(["ckpt", "ls", "s3://no-such-bucket-x/y", "--s3-endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist: create it" in err
    assert main(["ckpt", "ls", url, "--s3-endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach the S3 endpoint" in err


def test_pending_manifest_renamed_conditionally(bucket: Bucket) -> None:
    """The fenced commit's last move (publish_step with a coordinator): a pending manifest
    becomes MANIFEST.json once; a second one for the same step is refused."""
    st = bucket.storage()
    st.write_atomic("step_000000000007/MANIFEST.pending-g1.ab.json", b"m1")
    st.rename("step_000000000007/MANIFEST.pending-g1.ab.json", "step_000000000007/MANIFEST.json")
    assert st.read("step_000000000007/MANIFEST.json") == b"m1"
    assert st.listdir("step_000000000007") == ["MANIFEST.json"]
    st.write_atomic("step_000000000007/MANIFEST.pending-g2.cd.json", b"m2")
    with pytest.raises(StepCommittedError):
        st.rename(
            "step_000000000007/MANIFEST.pending-g2.cd.json", "step_000000000007/MANIFEST.json"
        )
    assert st.read("step_000000000007/MANIFEST.json") == b"m1"
    with pytest.raises(NotImplementedError):  # no directory moves on an object store
        st.rename("step_000000000007", "quarantine/step_000000000007")


def _coalesced_restore(bucket: Bucket, shm_namespace: str, read_range_bytes: int) -> int:
    """Restore a 4 MiB tensor saved in 64 KiB chunks through a counting proxy; returns the
    GETs the restore sent (data, manifest, index and listings)."""
    url = f"s3://{bucket.name}/run"
    persist = PersistConfig(chunk_bytes=64 << 10)
    mgr = CheckpointManager(
        CheckpointConfig(
            url,
            namespace=shm_namespace,
            persist=persist,
            s3=S3Config(endpoint_url=bucket.server.url),
        )
    )
    state = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))}
    try:
        mgr.save(state, 1)
    finally:
        mgr.close()
    target = {"w": torch.zeros(1 << 20)}
    with FaultProxy(bucket.server.port) as proxy:
        config = S3Config(endpoint_url=proxy.url, read_range_bytes=read_range_bytes)
        assert restore_state(S3Storage(url, config), target).step == 1
    assert torch.equal(target["w"], state["w"])  # bit-identical
    return proxy.seen.get("GET obj", 0)


def test_restore_reads_chunks_in_few_large_ranged_gets(bucket: Bucket, shm_namespace: str) -> None:
    """64 chunks in one pack: read in ranged GETs of up to read_range_bytes (1 MiB: 4 of
    them), not one GET per chunk."""
    assert _coalesced_restore(bucket, shm_namespace, MIB) <= 4 + 6  # + manifest, index, lists
