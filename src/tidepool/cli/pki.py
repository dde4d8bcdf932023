"""`tidepool pki init` and `tidepool pki issue`: a lab CA, the gateway's certificate and workers' certificates."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..settings import Settings
from .output import OK, TASK_FAILED, USAGE, complain

if TYPE_CHECKING:
    from ..gateway.pki import PkiError

# The crypto (and the cryptography package, ~50 ms to import) is loaded by these commands only: the
# parser of every command registers them.


def cmd_init(args: argparse.Namespace, settings: Settings) -> int:
    from ..gateway import pki

    directory: Path = args.dir
    try:
        lab = pki.init(directory, hosts=args.host, ca_days=args.ca_days or pki.CA_DAYS,
                       days=args.days or pki.LEAF_DAYS, force=args.force)
    except pki.PkiError as exc:
        return _refused(exc)
    sans = ", ".join(_sans(lab.gateway.cert))
    _wrote(lab.ca.cert, "the CA's certificate: the gateway's client_ca_file and each worker's store.ca_file")
    _wrote(lab.ca.key, "the CA's private key (0600): keep it here; `tidepool pki issue` signs with it")
    _wrote(lab.gateway.cert, f"the gateway's certificate (serverAuth; {sans})")
    _wrote(lab.gateway.key, "the gateway's private key (0600)")
    here = shlex.quote(str(directory))
    print(f"\nnext: a certificate for each remote worker:\n  tidepool pki issue {here} NAME\n"
          "and in the gateway's config:\n  [gateway]\n"
          f"  cert_file = {_toml(lab.gateway.cert)}\n  key_file = {_toml(lab.gateway.key)}\n"
          f"  client_ca_file = {_toml(lab.ca_file)}")
    return OK


def cmd_issue(args: argparse.Namespace, settings: Settings) -> int:
    from ..gateway import pki

    directory: Path = args.dir
    try:
        issued = pki.issue(directory, args.name, days=args.days or pki.LEAF_DAYS, force=args.force)
    except pki.PkiError as exc:
        return _refused(exc)
    _wrote(issued.cert, f"worker {args.name}'s client certificate (clientAuth; CN {args.name})")
    _wrote(issued.key, f"worker {args.name}'s private key (0600)")
    print(f"\nnext: copy these two files and {pki.ca_files(directory).cert} to the worker; in its config:\n"
          "  [store]\n  url = \"https://GATEWAY:PORT\"\n"
          f"  cert_file = {_toml(issued.cert)}\n  key_file = {_toml(issued.key)}\n"
          f"  ca_file = {_toml(pki.ca_files(directory).cert)}")
    return OK


def _refused(exc: PkiError) -> int:
    from ..gateway.pki import BadName

    complain(f"tidepool pki: {exc}")
    return USAGE if isinstance(exc, BadName) else TASK_FAILED


def _wrote(path: Path, what: str) -> None:
    print(f"wrote {path}  {what}")


def _toml(path: Path) -> str:
    return '"' + str(path.absolute()).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _sans(cert_file: Path) -> list[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [f"DNS {n}" for n in sans.get_values_for_type(x509.DNSName)] + [
        f"IP {ip}" for ip in sans.get_values_for_type(x509.IPAddress)]


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of days") from None
    if days < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 day, got {days}")
    return days


def add_commands(add: Any) -> None:
    bare = argparse.ArgumentParser(add_help=False)  # these commands talk to no daemon and read no config
    p = add("pki", None, "a lab CA and the certificates of the gateway and its workers", common=bare)
    p.set_defaults(config=None)  # settings are loaded for every command: the default places, never needed here
    sub = p.add_subparsers(dest="pki_command", metavar="{init,issue}", required=True)
    init = sub.add_parser("init", help="a new CA and the gateway's certificate in DIR")
    init.set_defaults(func=cmd_init)
    init.add_argument("dir", type=Path, metavar="DIR")
    init.add_argument("--host", action="append", default=[], metavar="NAME",
                      help="a DNS name or IP address the gateway is reached by (repeatable); localhost, "
                           "127.0.0.1, ::1 and this machine's host name are always included")
    init.add_argument("--days", type=_days, help="the gateway certificate's validity (default a year)")
    init.add_argument("--ca-days", type=_days, help="the CA's validity (default ten years)")
    init.add_argument("--force", action="store_true", help="replace an existing CA and gateway certificate")
    issue = sub.add_parser("issue", help="a worker's client certificate (CN = NAME) signed by DIR's CA")
    issue.set_defaults(func=cmd_issue)
    issue.add_argument("dir", type=Path, metavar="DIR")
    issue.add_argument("name", metavar="NAME", help="the worker's identity: a DNS name, also the files' name")
    issue.add_argument("--days", type=_days, help="validity (default a year)")
    issue.add_argument("--force", action="store_true", help="replace NAME's existing certificate and key")
