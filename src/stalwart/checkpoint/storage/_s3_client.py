"""The boto3 client of :class:`~stalwart.checkpoint.storage.s3.S3Storage` and the one-line
errors its failures become.

boto3 is imported only here (when an ``s3://`` storage is first used). Credentials come
from boto3's standard chain (environment, shared config/credentials files, SSO, instance or
container roles); the endpoint from :attr:`S3Config.endpoint_url` or, when that is unset,
from boto3's own settings (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the config file).
Transient failures (5xx, ``SlowDown`` and other throttling, dropped connections) are retried
by botocore's ``standard`` retry mode: exponential backoff with jitter, up to
``max_attempts`` tries per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError, StorageUnavailableError

__all__ = ["S3Config", "make_client", "not_found", "translate"]


@dataclass(frozen=True)
class S3Config:
    """How an ``s3://`` checkpoint storage talks to the store."""

    endpoint_url: str | None = None
    """The S3 endpoint (a MinIO, Ceph or test server: ``http://127.0.0.1:9000``); ``None``
    leaves it to boto3 (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, the AWS config file,
    else AWS itself)."""

    part_bytes: int = 16 << 20
    """Size of one multipart-upload part. S3 requires >= 5 MiB (all but the last part);
    an object smaller than one part is written with one put."""

    parallel_parts: int = 4
    """Parts of one stream uploaded at once. A stream holds at most ``parallel_parts + 1``
    part buffers: memory is bounded by ``(parallel_parts + 1) * part_bytes`` per open
    stream, whatever the shard's size."""

    read_threads: int = 16
    """Ranged reads in flight during a restore (each lands in its destination tensor: more
    of them cost connections, not memory)."""

    read_range_bytes: int = 16 << 20
    """Bytes of one ranged read during a restore: the chunks of a pack are read in runs of
    up to this size (one GetObject each, straight into the tensors), not one request per
    chunk."""

    max_attempts: int = 5
    """Tries per request (botocore's standard retry mode, exponential backoff with jitter)
    on transient errors: 5xx, throttling (``SlowDown``), dropped connections."""

    connect_timeout_s: float = 5.0
    """Seconds to open a connection to the endpoint."""

    read_timeout_s: float = 60.0
    """Seconds to wait for a response (per request, per try)."""

    def __post_init__(self) -> None:
        if self.part_bytes < 5 << 20:
            raise ConfigError(
                f"S3 part size {self.part_bytes} is below S3's minimum of 5 MiB; use >= 5242880"
            )
        if (
            min(self.parallel_parts, self.max_attempts, self.read_threads, self.read_range_bytes)
            < 1
        ):
            raise ConfigError(
                "S3 parallel_parts, read_threads, read_range_bytes and max_attempts must be >= 1"
            )


def make_client(config: S3Config, url: str) -> Any:
    """A thread-safe boto3 S3 client for ``config``; one-line ConfigError without boto3."""
    try:
        import boto3
        import botocore.config
    except ImportError as err:
        raise ConfigError(
            f"checkpoint URL {url!r} needs boto3: pip install 'stalwart[s3]'"
        ) from err
    bc = botocore.config.Config(
        retries={"mode": "standard", "max_attempts": config.max_attempts},
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        max_pool_connections=max(config.parallel_parts * 2, config.read_threads) + 4,
    )
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=config.endpoint_url, config=bc)


_CREDENTIALS = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})


def error_code(err: BaseException) -> str:
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def not_found(err: BaseException) -> bool:
    """Whether a botocore ClientError says the key does not exist."""
    return error_code(err) in _MISSING


def translate(err: BaseException, url: str, endpoint: str, what: str) -> BaseException:
    """The stalwart error for a botocore failure of ``what`` (one line naming the fix), or
    ``err`` itself when it is not the store's (a bug, a KeyboardInterrupt)."""
    import botocore.exceptions as bx

    where = f"{url} (endpoint {endpoint})"
    if isinstance(err, bx.NoCredentialsError | bx.PartialCredentialsError):
        return StorageUnavailableError(
            f"no AWS credentials for {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE or an instance role (the standard AWS chain)"
        )
    if isinstance(
        err, bx.EndpointConnectionError | bx.ConnectionClosedError | bx.ConnectTimeoutError
    ):
        return StorageUnavailableError(
            f"cannot reach the S3 endpoint of {where} while {what} ({type(err).__name__}); "
            "check --s3-endpoint / AWS_ENDPOINT_URL and the network"
        )
    if isinstance(err, bx.ReadTimeoutError | bx.ConnectionError | bx.HTTPClientError):
        return StorageUnavailableError(
            f"the S3 endpoint of {where} dropped the connection while {what} after the "
            f"retries ({type(err).__name__}); check the endpoint and the network"
        )
    if isinstance(err, bx.ClientError):
        code = error_code(err)
        if code == "NoSuchBucket":
            return StorageUnavailableError(
                f"bucket of {where} does not exist: create it or fix the URL"
            )
        if code in _CREDENTIALS:
            return StorageUnavailableError(
                f"the S3 store refused the credentials for {where} while {what} ({code}); "
                "check the AWS credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and their access"
            )
        return StorageUnavailableError(
            f"the S3 store failed {what} on {where} after the retries: {code or err}"
        )
    return err
