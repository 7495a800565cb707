"""Masking at ingress: secrets and e-mail addresses, optionally hosts, IPs and user names.

Every line that the engine extracts from a log passes through `Masker.mask` before any parser
sees it, and every string of the report passes through `Masker.finalize` on the way out, so a
secret never reaches any output. Host masking is consistent: one host always becomes the same
alias (``host-1``), so correlation across ranks still works.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from enum import Enum

# Option and variable names that hold a secret: the name ends in one of these words (``--hf_token``,
# ``--db-password``, ``WANDB_API_KEY``), or has one as a word of its own followed by more
# (``--token-file``); never a longer word (``--tokenizer``, ``--author``).
_SECRET_WORDS = (
    r"(?:api[_\-]?key|apikey|access[_\-]?key|secret[_\-]?key|private[_\-]?key|secret|token|passw(?:or)?d"
    r"|passphrase|pwd|auth|credentials?|accountkey)"
)
_SECRET_NAME_RE = re.compile(rf"(?i:^[\w.\-]*?{_SECRET_WORDS}(?:[_\-][\w\-]*)?$)")
# Environment variables: the same names, but not the shell's PWD and OLDPWD (a directory, not a secret).
_ENV_SECRET_NAME_RE = re.compile(rf"(?i:^[\w.\-]*?{_SECRET_WORDS.replace('|pwd', '')}(?:[_\-][\w\-]*)?$)")
#: The shortest environment value taken as a literal secret (shorter ones are common words and numbers).
MIN_ENV_SECRET = 6

_SECRET_RE = re.compile(
    r"""
      (?P<pem>-----BEGIN[A-Z ]*PRIVATE KEY-----)
    | (?P<aws>\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA)[0-9A-Z]{16}\b)
    | (?P<gcp>\bAIza[0-9A-Za-z_\-]{35}\b)
    | (?P<hf>\bhf_[A-Za-z0-9]{30,}\b)
    | (?P<gh>\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})\b)
    | (?P<slack>\bxox[abposr]-[A-Za-z0-9-]{10,})
    | (?P<sk>\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,})
    | (?P<jwt>\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})
    | (?P<bearer>\b(?:[Bb]earer|[Bb]asic|[Tt]oken)\s+)(?P<bearer_v>[A-Za-z0-9\-._~+/]{12,}=*)
    | (?P<flag>(?<![\w\-])--?(?i:[\w.\-]*?(?:api[_\-]?key|apikey|access[_\-]?key|secret[_\-]?key
                              |private[_\-]?key|secret|token|passw(?:or)?d|passphrase|pwd|auth|credentials?|accountkey))(?:[_\-][\w\-]*)?(?:=|\s+))
      (?P<flag_v>[^\s"',;&]+)
    | (?P<urlcred>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s/:@'"]+:)(?P<urlcred_v>[^\s/@'"]+)(?=@)
    | (?P<kv>(?i:\b[\w.\-]*(?:api[_\-]?key|apikey|access[_\-]?key|secret[_\-]?key|secret|token|passw(?:or)?d
                              |pwd|auth|credential|accountkey|sig)\b["']?\s*[:=]\s*["']?))(?P<kv_v>[^\s"',;&]{6,})
    | (?P<email>\b[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b)
    """,
    re.X,
)
_IPV4_RE = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)(?![\w.])")
_USER_PATH_RE = re.compile(r"(/(?:home|Users|users|homes|scratch|people|u)/)([A-Za-z_][\w.\-]{0,31})(?=/|\b)")
_ALIAS_RE = re.compile(r"(?:host|ip|user)-\d+")
_TOKEN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


_HINTS = (
    "PRIVATE KEY",
    "AKIA",
    "ASIA",
    "AGPA",
    "AIDA",
    "AROA",
    "ANPA",
    "AIza",
    "hf_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "xox",
    "sk-",
    "eyJ",
    "://",
    "@",
)
# "sig" only as a key (Azure SAS `sig=`): the bare word is in every "signal" and "SIGTERM" line,
# and "gh" above only as a GitHub token prefix ("caught" is in every watchdog line).
_KV_HINTS = (
    "key",
    "secret",
    "token",
    "passw",
    "passph",
    "pwd",
    "auth",
    "credential",
    "sig=",
    "sig:",
    'sig"',
    "sig'",
    "sig ",
    "bearer",
    "basic ",
)


def _may_hold_secret(text: str) -> bool:
    """Cheap substring test before the (slower) secret regex: most log lines hold none."""
    if any(map(text.__contains__, _HINTS)):  # map: the tests run at C speed
        return True
    return any(map(text.lower().__contains__, _KV_HINTS))


class Masker:
    """Replace secrets (always) and hosts/IPs/users (with ``mask_hosts``), consistently."""

    def __init__(self, mask_hosts: bool = False, env: Mapping[str, str] | None = None) -> None:
        """Args:
        mask_hosts: also mask hostnames, IP addresses and user names in paths.
        env: an environment whose secret-named variables' values (``HF_TOKEN``, ``DB_PASSWORD``...)
            are masked wherever they appear, whatever their form; ``os.environ`` when not given.
        """
        self.mask_hosts = mask_hosts
        self._hosts: dict[str, str] = {}
        self._ips: dict[str, str] = {}
        self._users: dict[str, str] = {}
        source = os.environ if env is None else env
        # Longest first: a secret that contains another is replaced whole.
        secrets = {
            v
            for k, v in source.items()
            if _ENV_SECRET_NAME_RE.match(k) and len(v) >= MIN_ENV_SECRET and not v.isspace()
        }
        self._literals = sorted(secrets, key=len, reverse=True)

    def _secret(self, m: re.Match[str]) -> str:
        kind = m.lastgroup or "secret"
        for prefix_group, value_group in (
            ("bearer", "bearer_v"),
            ("flag", "flag_v"),
            ("urlcred", "urlcred_v"),
            ("kv", "kv_v"),
        ):
            if kind == value_group:
                prefix = m.group(prefix_group)
                if kind == "urlcred_v":  # the user part may be a key of its own (s3://AKIA...:SECRET@bucket)
                    prefix = _SECRET_RE.sub(self._secret, prefix)
                return f"{prefix}<secret>"
        return "<email>" if kind == "email" else "<secret>"

    def mask(self, text: str) -> str:
        """Mask one line at ingress."""
        if not text:
            return text
        for literal in self._literals:
            if literal in text:
                text = text.replace(literal, "<secret>")
        if _may_hold_secret(text):
            text = _SECRET_RE.sub(self._secret, text)
        if self.mask_hosts:
            text = self._mask_hosts(text)
        return text

    def learn_host(self, host: str) -> str:
        """Register a hostname seen in a structural field; return what the report shows for it."""
        if not host or not self.mask_hosts or _ALIAS_RE.fullmatch(host):
            return host
        if _IPV4_RE.fullmatch(host):
            return self._alias(self._ips, host, "ip")
        short = host.split(".", 1)[0]
        alias = self._hosts.get(host) or self._hosts.get(short)
        if alias is None:
            alias = f"host-{len(set(self._hosts.values())) + 1}"
        self._hosts[host] = alias
        self._hosts[short] = alias
        return alias

    @staticmethod
    def _alias(table: dict[str, str], key: str, kind: str) -> str:
        if key not in table:
            table[key] = f"{kind}-{len(table) + 1}"
        return table[key]

    def _mask_hosts(self, text: str) -> str:
        text = _IPV4_RE.sub(lambda m: self._alias(self._ips, m.group(0), "ip"), text)
        text = _USER_PATH_RE.sub(lambda m: m.group(1) + self._alias(self._users, m.group(2), "user"), text)
        if self._hosts:
            hosts = self._hosts

            def repl(m: re.Match[str]) -> str:
                tok = m.group(0)
                if tok in hosts:
                    return hosts[tok]
                head = tok.split(".", 1)[0]
                return hosts[head] + "" if head in hosts and "." in tok else tok

            text = _TOKEN_RE.sub(repl, text)
        return text

    def finalize(self, text: str) -> str:
        """Mask a string on its way out, with every host learned by the end of the scan."""
        return self.mask(text)

    def mask_argv(self, argv: list[str]) -> list[str]:
        """Mask a command line given as its words: ``--token VALUE`` (the value in the next word),
        ``--password=VALUE`` and every secret the words hold themselves."""
        out: list[str] = []
        hide_next = False
        for word in argv:
            if hide_next:
                out.append("<secret>")
                hide_next = False
                continue
            out.append(self.finalize(word))
            name = word.lstrip("-")
            hide_next = word.startswith("-") and "=" not in word and bool(_SECRET_NAME_RE.match(name))
        return out

    def finalize_obj(self, obj: object) -> object:
        """`finalize` every string inside a JSON-like object or dataclass (a copy; keys included). A list
        of strings is masked as a command line (:meth:`mask_argv`)."""
        if isinstance(obj, Enum):  # a closed set of names (a StrEnum included): none is a secret
            return obj
        if isinstance(obj, str):
            return self.finalize(obj)
        if isinstance(obj, list | tuple):
            if obj and all(isinstance(v, str) for v in obj):
                masked: list[object] = list(self.mask_argv([str(v) for v in obj]))
            else:
                masked = [self.finalize_obj(v) for v in obj]
            return masked if isinstance(obj, list) else tuple(masked)
        if isinstance(obj, dict):
            return {self.finalize_obj(k): self.finalize_obj(v) for k, v in obj.items()}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(
                obj, **{f.name: self.finalize_obj(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            )
        return obj
