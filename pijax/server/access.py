"""Who may call the server: the `Host` allow-list (DNS rebinding) and the API key.

A web page can make a browser send requests to a server on the user's loopback: it points a name
it controls at 127.0.0.1 (DNS rebinding), and the browser then treats the server as that name's
origin. Such requests carry the page's name in `Host`, so only requests naming this server are
answered: localhost, 127.0.0.1, [::1] (any loopback address), the bound address, the machine's
own names and addresses when bound to all interfaces (0.0.0.0, ::), and `--allowed_hosts`. The
port is not compared (a proxy may forward from another). A request without `Host` (HTTP/1.0)
cannot come from a browser and passes.

`--api_key` adds a Bearer token (`Authorization: Bearer KEY`, what the `openai` client sends),
compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import socket
from typing import Iterable

from pijax.errors import ConfigError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})
PUBLIC_PATHS = frozenset({"/health", "/"})  # Answered without the API key (not the Host check).


def host_name(header: str) -> str:
  """The name in a `Host` header, lower-case, without port, brackets or a trailing dot:
  "LocalHost:8080" -> "localhost", "[::1]:8080" -> "::1"."""
  host = header.strip().lower()
  if host.startswith("["):  # [v6] or [v6]:port
    host = host[1:].split("]", 1)[0]
  elif host.count(":") == 1:  # name:port (a bare v6 address has several colons)
    host = host.split(":", 1)[0]
  return host.rstrip(".")


@functools.lru_cache(maxsize=256)
def _is_local_address(address: str) -> bool:
  """Whether `address` (an IP literal) belongs to this machine: it can be bound."""
  ip = ipaddress.ip_address(address)
  family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as s:
      s.bind((address, 0))
    return True
  except OSError:
    return False


class HostPolicy:
  """Which `Host` headers the server answers (see the module docstring).

  Args:
    bound: the address the server listens on (--host).
    allowed: extra names (--allowed_hosts); "*" allows every Host (behind a trusted proxy).
  """

  def __init__(self, bound: str = "127.0.0.1", allowed: Iterable[str] = ()):
    allowed = [host_name(a) for a in allowed if a.strip()]
    self.any = "*" in allowed
    self.bound = host_name(bound)
    self.wildcard = self.bound in WILDCARD_ADDRESSES
    names = set(LOOPBACK_NAMES) | set(allowed)
    if not self.wildcard:
      names.add(self.bound)
    else:
      names |= {host_name(socket.gethostname()), host_name(socket.getfqdn())}
    self.names = frozenset(names)

  def allows(self, header: str | None) -> bool:
    """Whether a request with this `Host` header (None: absent) is answered."""
    if self.any or header is None:
      return True
    name = host_name(header)
    if name in self.names:
      return True
    try:
      ip = ipaddress.ip_address(name)
    except ValueError:
      return False
    return ip.is_loopback or (self.wildcard and _is_local_address(str(ip)))


def check_api_key(key: str | None) -> str | None:
  """The --api_key value, checked: None (no key), or printable ASCII without spaces.

  Raises:
    ConfigError: an empty key, or one with spaces or characters a header cannot carry.
  """
  if key is None:
    return None
  if not key or not key.isascii() or not key.isprintable() or " " in key:
    raise ConfigError("--api_key must be a non-empty string of printable ASCII characters "
                      "without spaces (it travels in the Authorization header).")
  return key


def key_matches(authorization: str | None, key: str) -> bool:
  """Whether an `Authorization` header carries `Bearer <key>` (constant-time comparison)."""
  scheme, _, token = (authorization or "").strip().partition(" ")
  if scheme.lower() != "bearer":
    token = ""
  return hmac.compare_digest(token.strip().encode("utf-8", "replace"), key.encode("utf-8"))


def is_loopback_bind(host: str) -> bool:
  """Whether listening on `host` reaches this machine only (every address it resolves to is a
  loopback address)."""
  try:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except socket.gaierror:
    return False
  addresses = {info[4][0] for info in infos}
  return bool(addresses) and all(
      ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)
