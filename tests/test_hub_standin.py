"""The real huggingface_hub client (2.4.0) against HubStandIn, the local stand-in for the Hub.

These pin down that the stand-in answers the way the client needs, so the export/push tests
built on it test the studio and not the stand-in. Run: .venv/bin/python -m pytest -q tests/test_hub_standin.py
"""

import os

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

from hub_standin import HubStandIn, point_hub_client_at

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

ALICE, BOB, WRONG = "hf_alice_write_token_0123", "hf_bob_write_token_4567", "hf_not_a_real_token_89"
READER = "hf_alice_read_token_abcd"


@pytest.fixture
def hub(monkeypatch):
    tokens = {
        ALICE: {"user": "alice", "orgs": ["alice-org"]},
        READER: {"user": "alice", "orgs": ["alice-org"], "role": "read"},
        BOB: {"user": "bob"},
    }
    with HubStandIn(tokens=tokens) as standin:
        point_hub_client_at(standin, monkeypatch)
        yield standin
    assert standin.errors == [], "the stand-in met requests it could not handle"


@pytest.fixture
def export_dir(tmp_path):
    """A small model folder: a text file (regular upload) and a .safetensors file (LFS upload)."""
    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    (folder / "sub" / "notes.txt").write_text("trained on trn1\n")
    (folder / "model.safetensors").write_bytes(os.urandom(300_000))
    return folder


def status_of(excinfo) -> int:
    return excinfo.value.response.status_code


def test_private_push_arrives_byte_for_byte_in_one_commit(hub, export_dir, tmp_path):
    api = HfApi(endpoint=hub.url, token=ALICE)
    url = api.create_repo("alice/tiny", private=True)
    assert url == f"{hub.url}/alice/tiny"
    api.upload_folder(repo_id="alice/tiny", folder_path=export_dir, commit_message="Export run 1")

    repo = hub.repos["alice/tiny"]
    local = {p.relative_to(export_dir).as_posix(): p.read_bytes() for p in export_dir.rglob("*") if p.is_file()}
    assert repo["private"] is True
    assert repo["files"] == local
    assert repo["lfs_paths"] == {"model.safetensors"}
    assert [(c["summary"], sorted(c["paths"])) for c in repo["commits"]] == [("Export run 1", sorted(local))]
    # the big file went through the LFS upload, not inside the commit
    puts = [r for r in hub.requests if r.method == "PUT"]
    assert [r.body for r in puts] == [local["model.safetensors"]]
    commit = next(r for r in hub.requests if "/commit/" in r.path)
    assert b'"lfsFile"' in commit.body and len(commit.body) < 10_000

    info = api.model_info("alice/tiny")
    assert info.private is True and info.sha == repo["commits"][0]["oid"]
    assert sorted(s.rfilename for s in info.siblings) == sorted(local)
    for path, data in local.items():
        downloaded = hf_hub_download("alice/tiny", path, endpoint=hub.url, token=ALICE, cache_dir=tmp_path / "cache")
        assert open(downloaded, "rb").read() == data

    # a private repo is invisible without the owner's token
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=BOB).model_info("alice/tiny")
    assert not any(ALICE.encode() in r.body for r in hub.requests)
    assert not any(ALICE.encode() in data for data in repo["files"].values())


def test_pushing_the_same_folder_again_makes_no_commit(hub, export_dir):
    api = HfApi(endpoint=hub.url, token=ALICE)
    api.create_repo("alice-org/tiny")
    api.upload_folder(repo_id="alice-org/tiny", folder_path=export_dir)
    api.upload_folder(repo_id="alice-org/tiny", folder_path=export_dir)
    assert len(hub.repos["alice-org/tiny"]["commits"]) == 1
    assert hub.repos["alice-org/tiny"]["private"] is False
    assert len([r for r in hub.requests if r.method == "PUT"]) == 1


def test_whoami_and_a_wrong_token(hub, export_dir):
    me = HfApi(endpoint=hub.url).whoami(token=ALICE)
    assert me["name"] == "alice" and [o["name"] for o in me["orgs"]] == ["alice-org"]
    assert me["auth"]["accessToken"]["role"] == "write"

    wrong = HfApi(endpoint=hub.url, token=WRONG)
    with pytest.raises(HfHubHTTPError) as excinfo:
        wrong.whoami()
    assert status_of(excinfo) == 401
    with pytest.raises(HfHubHTTPError) as excinfo:
        wrong.create_repo("alice/tiny")
    assert status_of(excinfo) == 401 and "Invalid credentials in Authorization header" in str(excinfo.value)

    HfApi(endpoint=hub.url, token=ALICE).create_repo("alice/tiny")
    with pytest.raises(HfHubHTTPError) as excinfo:
        wrong.upload_folder(repo_id="alice/tiny", folder_path=export_dir)
    assert status_of(excinfo) == 401
    assert hub.repos["alice/tiny"]["commits"] == []


def test_no_rights_on_someone_elses_namespace(hub, export_dir):
    alice = HfApi(endpoint=hub.url, token=ALICE)
    with pytest.raises(HfHubHTTPError) as excinfo:
        alice.create_repo("bob/tiny")
    assert status_of(excinfo) == 403 and "namespace" in str(excinfo.value)

    HfApi(endpoint=hub.url, token=BOB).create_repo("bob/tiny")
    with pytest.raises(HfHubHTTPError) as excinfo:
        alice.upload_folder(repo_id="bob/tiny", folder_path=export_dir)
    assert status_of(excinfo) == 403
    assert hub.repos["bob/tiny"]["files"] == {}

    reader = HfApi(endpoint=hub.url, token=READER)
    assert reader.whoami()["auth"]["accessToken"]["role"] == "read"
    with pytest.raises(HfHubHTTPError) as excinfo:
        reader.create_repo("alice/tiny")
    assert status_of(excinfo) == 403


def test_creating_an_existing_repo(hub):
    api = HfApi(endpoint=hub.url, token=ALICE)
    api.create_repo("alice/tiny", private=True)
    with pytest.raises(HfHubHTTPError) as excinfo:
        api.create_repo("alice/tiny")
    assert status_of(excinfo) == 409
    assert api.create_repo("alice/tiny", exist_ok=True) == f"{hub.url}/alice/tiny"
    assert hub.repos["alice/tiny"]["private"] is True


def test_a_failed_commit_records_nothing_and_the_next_push_works(hub, export_dir):
    api = HfApi(endpoint=hub.url, token=ALICE)
    api.create_repo("alice/tiny")
    hub.fail_next_commit = True
    with pytest.raises(HfHubHTTPError) as excinfo:
        api.upload_folder(repo_id="alice/tiny", folder_path=export_dir)
    assert status_of(excinfo) == 500
    assert hub.repos["alice/tiny"]["commits"] == [] and hub.repos["alice/tiny"]["files"] == {}

    api.upload_folder(repo_id="alice/tiny", folder_path=export_dir)
    assert len(hub.repos["alice/tiny"]["commits"]) == 1
