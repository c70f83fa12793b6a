"""``python -m kvlens.healthcheck``: the image's HEALTHCHECK, on the standard library alone.

It asks ``/healthz`` on the loopback at ``KVLENS_PORT`` (default 9433), over HTTPS when
``KVLENS_TLS_CERT_FILE`` is set, as ``kvlens serve`` reads the same variables; exit 0 on 200, else
1 with one line saying why. The certificate is not verified: it names the service, not
127.0.0.1, and a liveness check on the loopback needs to know only that the server answers.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request
from collections.abc import Mapping

from kvlens.limits import DEFAULT_PORT


def healthz_url(environ: Mapping[str, str]) -> str:
    scheme = "https" if environ.get("KVLENS_TLS_CERT_FILE") else "http"
    return f"{scheme}://127.0.0.1:{environ.get('KVLENS_PORT') or DEFAULT_PORT}/healthz"


def main(environ: Mapping[str, str] = os.environ) -> int:
    url = healthz_url(environ)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as answer:
            status = int(answer.status)
    except (OSError, ValueError) as error:  # refused, timed out, an HTTP error, a bad port
        print(f"kvlens healthcheck: {url}: {error}", file=sys.stderr)
        return 1
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
