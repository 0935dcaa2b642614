"""The configuration syntax both daemons share: one spelling of booleans, durations, sizes and listen
addresses, and one layering of flags over environment over config file over defaults.

Each program keeps its own table of settings (flag name -> parser); this module only knows how a value
is written and which layer wins, so `on` means true and `1m30s` means 90 seconds to the agent and the
server alike, and a bad value is reported the same way by both.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable, Iterable, Mapping

import yaml


class ConfigError(ValueError):
    """A bad flag, environment variable or config file entry; str() is the one-line message to print."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing the whole usage and exiting (--help still prints)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


# --- values ---------------------------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(value: Any) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case), or a YAML boolean."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected true or false (yes/no, on/off, 1/0), got {value!r}")


# Prometheus duration units, largest first; each may appear once, in this order ("1h30m", "1m30s", "500ms").
_DURATION_UNITS = {"y": 365 * 86400.0, "w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+)(ms|y|w|d|h|m|s)")
_PLAIN_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


def parse_duration(value: Any, *, allow_zero: bool = False) -> float:
    """Seconds from a Prometheus-style duration ("1m30s", "500ms", "2h", "7d") or plain seconds ("2.5", 2.5).

    Must be positive; with allow_zero, zero ("0", "0s") is accepted too, for settings where it means off.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 30s, 1m30s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        parsed = _duration_text(text)
        if parsed is None:
            raise ValueError(f"expected a duration such as 30s, 1m30s or 500ms, got {value!r}")
        seconds = parsed
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"expected a {'non-negative' if allow_zero else 'positive'} duration, got {value!r}")
    return seconds


def _duration_text(text: str) -> float | None:
    if _PLAIN_NUMBER.fullmatch(text):
        return float(text)
    total, end, last_rank = 0.0, 0, -1
    ranks = list(_DURATION_UNITS)
    for match in _DURATION_PART.finditer(text):
        if match.start() != end:
            return None
        rank = ranks.index(match.group(2))
        if rank <= last_rank:  # "30s1m" or "1m1m": Prometheus refuses both
            return None
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        end, last_rank = match.end(), rank
    return total if text and end == len(text) else None


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
_SIZE = re.compile(r"([0-9]+)\s*([KMGT]i?B|B)?")


def parse_size(value: Any) -> int:
    """Bytes from plain bytes (4194304) or a number with a unit: 4MiB (1024-based) or 4MB (1000-based)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 32MiB, got {value!r}")
    match = _SIZE.fullmatch(str(value).strip())
    if not match:
        raise ValueError(f"expected a size such as 32MiB, 4MB or plain bytes, got {value!r}")
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2) or ""]
    if size <= 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    return size


def parse_listen_address(value: Any) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' (every interface) or '[v6]:PORT' -> (host, port); the host comes unbracketed."""
    text = "" if value is None else str(value).strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, :PORT or [IPv6]:PORT, got {text!r}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port must be 0-65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host:
            raise ValueError(f"empty IPv6 host in {text!r}")
    elif ":" in host:
        raise ValueError(f"write IPv6 hosts in brackets, e.g. [::1]:{port}, got {text!r}")
    return host, port


def format_address(host: str, port: int) -> str:
    """(host, port) back to the HOST:PORT spelling, brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- layers ---------------------------------------------------------------------------------------------


def env_name(prefix: str, key: str) -> str:
    """PREFIX + the flag name upper-cased with dots and dashes as underscores (GPUFLEET_AGENT_SAMPLE_INTERVAL)."""
    return prefix + re.sub(r"[.-]", "_", key).upper()


def read_config_file(path: str, known: Iterable[str]) -> dict[str, Any]:
    """The YAML file's mapping of flag names (without dashes) to values; ConfigError for an unreadable
    file, invalid YAML, anything but a mapping, or a key not in `known`."""
    try:
        with open(path, "rb") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"--config.file: cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--config.file: {path}{where} is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config.file: {path} must hold a mapping of flag names to values")
    known = set(known)
    for key in data:
        if key not in known:
            raise ConfigError(f"config file {path}: unknown key {key!r} (keys are flag names without dashes)")
    return data


def layered(
    parsers: Mapping[str, Callable[[Any], Any]],
    *,
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    env_prefix: str,
    file_values: Mapping[str, Any],
    file_path: str | None,
) -> dict[str, Any]:
    """Each setting's parsed value from the layer that wins: flag > environment > config file; settings set
    nowhere are absent (the program's default stands). A value its parser refuses is a ConfigError naming
    where it came from: `--flag: ...`, `ENV_NAME: ...` or `config file PATH: 'key': ...`."""
    values: dict[str, Any] = {}
    for key, parse in parsers.items():
        env = env_name(env_prefix, key)
        for origin, raw in (
            (f"--{key}", flags.get(key)),
            (env, environ.get(env)),
            (f"config file {file_path}: {key!r}", file_values.get(key)),
        ):
            if raw is None:
                continue
            try:
                values[key] = parse(raw)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{origin}: {exc}") from None
            break
    return values
