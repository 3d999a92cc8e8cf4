"""A `datasets` hub source (hf:NAME[:SUBSET]): reached in seconds or refused with what to do, then loaded."""
from __future__ import annotations

import os
import socket
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import datasets

from summarizer.errors import ConfigError, DataError


def is_hub(source) -> bool:
    return isinstance(source, str) and source.startswith("hf:")


OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # set: use datasets' local cache, never the network
PROBE_SECONDS = 5


def reach_hub(name: str) -> None:
    """Fail in seconds, with what to do instead, when the hub cannot be reached: otherwise `datasets` retries
    for minutes and ends in a traceback. Skipped when the user asked for offline use of a cached copy."""
    if any(os.environ.get(var, "").lower() in ("1", "true", "yes", "on") for var in OFFLINE_VARS):
        return
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    proxies = urllib.request.getproxies()  # HTTPS_PROXY, ALL_PROXY and the like, as datasets' requests use them
    proxy, via = proxies.get(url.scheme or "https") or proxies.get("all"), ""
    if proxy and not urllib.request.proxy_bypass(host):  # then the proxy is what must answer
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        via, host = f", through the proxy {proxy}", proxied.hostname
        port = proxied.port or {"https": 443, "socks5": 1080, "socks5h": 1080, "socks4": 1080}.get(proxied.scheme, 80)
    outcome: list = []

    def probe() -> None:  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(PROBE_SECONDS + 1)
    problem = outcome[0] if outcome else TimeoutError(f"no answer in {PROBE_SECONDS} s")
    if problem is not None:
        raise DataError(f"cannot reach the Hugging Face hub ({host}:{port}{via}: {problem}) to download {name}. "
                        f"Without a network, point data.source at a local copy (a directory of "
                        f"{{train,valid,test}}.jsonl[.gz] with source/target fields, or Rush-style "
                        f"{{split}}.article.txt + .title.txt), e.g. ARGS=\"data.source=DIR\"; or try `make smoke` "
                        f"on the bundled fixture. With a cached copy, set HF_HUB_OFFLINE=1")


def load_hub(source: str, cache_dir: Path) -> datasets.DatasetDict:
    """hf:NAME[:SUBSET] -> the hub's DatasetDict, with its own split names and columns."""
    name, _, subset = source[len("hf:"):].partition(":")
    if not name:
        raise ConfigError(f"data.source={source!r} names no dataset: write hf:NAME or hf:NAME:SUBSET")
    if not Path(name).exists():  # a local dataset directory or script needs no network
        reach_hub(name)
    try:
        try:
            return datasets.load_dataset(name, subset or None, cache_dir=str(cache_dir))
        except RuntimeError as exc:
            if "script" not in str(exc).lower():
                raise
            # datasets >= 4 no longer runs loading scripts (Harvard/gigaword is one); the hub keeps an
            # automatic Parquet conversion of such repos on this revision.
            return datasets.load_dataset(name, subset or None, cache_dir=str(cache_dir),
                                         revision="refs/convert/parquet")
    except Exception as exc:  # network, unknown name, missing subset: all surface here
        raise DataError(f"cannot load hub dataset {name!r}{f' subset {subset!r}' if subset else ''} "
                        f"({type(exc).__name__}: {exc}): check the name and your network, or point "
                        f"data.source at a local directory") from None
