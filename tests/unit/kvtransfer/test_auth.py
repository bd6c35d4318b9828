from __future__ import annotations

import hashlib
import hmac
import socket
import threading
from pathlib import Path

import pytest

from dsv4_kvtransfer.auth import (
    AuthError,
    check,
    client_handshake,
    load_token,
    proof,
    server_handshake,
)

TOKEN = b"0123456789abcdef-shared"


def test_proof_is_hmac_sha256_over_role_and_both_nonces() -> None:
    p = proof(TOKEN, b"client", b"S" * 32, b"C" * 32)
    assert (
        p
        == hmac.new(
            TOKEN, b"dsv4-kv/1|client|" + b"S" * 32 + b"|" + b"C" * 32, hashlib.sha256
        ).digest()
    )
    assert p != proof(TOKEN, b"server", b"S" * 32, b"C" * 32)
    assert p != proof(TOKEN, b"client", b"C" * 32, b"S" * 32)
    assert check(p, p.hex()) and not check(p, p.hex()[:-2] + "00")
    assert not check(p, "zz" * 32) and not check(p, 5) and not check(p, p.hex()[:10])


def _handshake(client_token: bytes, server_token: bytes) -> tuple[object, object]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    out: dict[str, object] = {}

    def server() -> None:
        try:
            out["server"] = server_handshake(b, server_token, "srv")
        except Exception as e:
            out["server"] = e
        finally:
            b.close()

    t = threading.Thread(target=server)
    t.start()
    try:
        out["client"] = client_handshake(a, client_token, "cli")
    except Exception as e:
        out["client"] = e
    a.close()
    t.join()
    return out["client"], out["server"]


def test_matching_tokens_authenticate_both_ways() -> None:
    assert _handshake(TOKEN, TOKEN) == ("srv", "cli")


def test_a_client_with_another_token_gives_up_before_proving_anything() -> None:
    client, server = _handshake(b"another-token-of-16-bytes", TOKEN)
    assert isinstance(client, AuthError) and "could not prove" in str(client)
    # the server saw the client leave, without ever receiving a proof
    assert isinstance(server, ConnectionError)


def test_load_token_strips_and_refuses_short_or_missing(tmp_path: Path) -> None:
    (tmp_path / "t").write_bytes(b"  " + TOKEN + b"\n")
    assert load_token(tmp_path / "t") == TOKEN
    (tmp_path / "s").write_bytes(b"short\n")
    with pytest.raises(AuthError, match="5 bytes; at least 16"):
        load_token(tmp_path / "s")
    with pytest.raises(AuthError, match="cannot read"):
        load_token(tmp_path / "missing")
