"""The tokens file: formats, refusals, hashing, and reloading when a mounted Secret changes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_dispatch.gateway import _auth
from agent_dispatch.gateway._auth import TokenRegistry, TokensFileError, hash_token, load_tokens_file


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_yaml_json_and_mapping_forms(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        f"alpha: {sha('alpha-token-0001')}\n"
        f"beta:\n  token_sha256: {sha('beta-token-0001').upper()}\n"
        f"gamma:\n  token_sha256: [{sha('gamma-old-00001')}, {sha('gamma-new-00001')}]\n"
    )
    registry = TokenRegistry.from_file(path)
    assert registry.tenants == {"alpha", "beta", "gamma"}
    assert registry.authenticate("alpha-token-0001") == "alpha"
    assert registry.authenticate("beta-token-0001") == "beta"  # hex is case-insensitive
    assert registry.authenticate("gamma-old-00001") == registry.authenticate("gamma-new-00001") == "gamma"
    assert registry.authenticate("nobody") is None
    assert registry.authenticate(sha("alpha-token-0001")) is None  # the hash itself is not a token

    as_json = tmp_path / "tokens.json"
    as_json.write_text(json.dumps({"alpha": {"token_sha256": sha("t-json-0000001")}}))
    assert TokenRegistry.from_file(as_json).authenticate("t-json-0000001") == "alpha"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("- a\n- b\n", "must map each tenant"),
        ("alpha: plaintext-token\n", "64 hex"),
        ("alpha: []\n", "a sha256 hex or a list"),
        ("alpha:\n  token: abc\n", "exactly the key token_sha256"),
        ("'bad tenant': " + "0" * 64 + "\n", "is not 1-200"),
        ("alpha: [unclosed\n", "not valid YAML or JSON"),
    ],
)
def test_refused_files_say_why_without_echoing_values(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(TokensFileError) as info:
        load_tokens_file(path)
    assert words in str(info.value)
    assert "plaintext-token" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TokensFileError, match="cannot be read"):
        load_tokens_file(tmp_path / "absent.yaml")


def test_written_file_holds_only_hashes_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tokens.yaml"
    _auth.write_tokens_file(path, {"local": [hash_token("the-plain-token-1")]})
    assert "the-plain-token-1" not in path.read_text()
    assert os.stat(path).st_mode & 0o077 == 0
    assert TokenRegistry.from_file(path).authenticate("the-plain-token-1") == "local"


def test_reloads_a_changed_file_and_keeps_the_last_good_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_auth, "RELOAD_CHECK_S", 0.0)
    path = tmp_path / "tokens.yaml"
    path.write_text(f"alpha: {sha('first-token-0001')}\n")
    registry = TokenRegistry.from_file(path)
    assert registry.authenticate("first-token-0001") == "alpha"

    # The kubelet swaps a mounted Secret atomically: a new file under the same name.
    fresh = tmp_path / "tokens.new"
    fresh.write_text(f"alpha: {sha('second-token-001')}\n")
    fresh.replace(path)
    assert registry.authenticate("second-token-001") == "alpha"
    assert registry.authenticate("first-token-0001") is None

    broken = tmp_path / "tokens.broken"
    broken.write_text("alpha: not-a-hash\n")
    broken.replace(path)
    assert registry.authenticate("second-token-001") == "alpha"  # the last good tokens stay


def test_an_admin_entry_is_an_administrator_not_a_tenant(tmp_path: Path) -> None:
    from agent_dispatch.gateway._auth import Principal

    path = tmp_path / "tokens.yaml"
    path.write_text(
        f"team: {hashlib.sha256(b'tenant-token').hexdigest()}\n"
        f"ops:\n  token_sha256: {hashlib.sha256(b'admin-token').hexdigest()}\n  role: admin\n"
    )
    registry = TokenRegistry.from_file(path)
    assert registry.tenants == {"team"}
    assert registry.authenticate("admin-token") is None  # the API never takes an admin as a tenant
    assert registry.identify("admin-token") == Principal("ops", admin=True)
    assert registry.identify("tenant-token") == Principal("team")
    path.write_text(f"ops:\n  token_sha256: {'0' * 64}\n  role: root\n")
    with pytest.raises(TokensFileError, match="role must be one of"):
        TokenRegistry.from_file(path)


_tokens = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["t1", "t2", "t3", "ops"]), st.booleans(), _tokens), max_size=12),
    st.lists(_tokens, max_size=6),
)
def test_a_token_resolves_to_whoever_lists_its_digest(
    entries: list[tuple[str, bool, str]], strangers: list[str]
) -> None:
    """Whatever the registry, a presented token resolves as a scan of every entry would (the later
    entry wins for a digest listed twice), and an unlisted one resolves to nobody."""
    principals: dict[_auth.Principal, tuple[bytes, ...]] = {}
    for name, admin, token in entries:
        who = _auth.Principal(name, admin=admin)
        principals[who] = (*principals.get(who, ()), hashlib.sha256(token.encode()).digest())
    registry = TokenRegistry(principals)
    for token in [t for _, _, t in entries] + strangers:
        digest = hashlib.sha256(token.encode()).digest()
        expected = None
        for who, digests in principals.items():
            if digest in digests:
                expected = who
        assert registry.identify(token) == expected
        assert registry.authenticate(token) == (None if expected is None or expected.admin else expected.name)
