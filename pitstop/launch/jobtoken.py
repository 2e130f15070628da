"""The job token: a secret made by the launcher; a process that cannot prove it holds it gets no role.

The token itself never crosses the control store. The controller publishes a
fresh nonce per applicant; the applicant answers ``HMAC-SHA256(token, nonce|pid)``;
the controller compares in constant time::

    applicant                     store                         controller
    set join/<id>/hello  ------>  pid, host
                                  join/<id>/nonce   <--------   32 random bytes
    set join/<id>/mac    ------>  hmac(token, nonce|id)
                                  join/<id>/verdict <--------   "ok" | "refused: ..."
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

ENV_TOKEN = "PITSTOP_JOB_TOKEN"


def new_token() -> str:
    return secrets.token_hex(32)


def mac(token: str, nonce: bytes, applicant: str) -> str:
    return hmac.new(token.encode(), nonce + b"|" + applicant.encode(), hashlib.sha256).hexdigest()


def verify(token: str, nonce: bytes, applicant: str, answer: str) -> bool:
    return hmac.compare_digest(mac(token, nonce, applicant), answer)


def token_from_env() -> str:
    return os.environ.get(ENV_TOKEN, "")
