"""A stand-in for the Hugging Face Hub: a standard-library HTTP server on 127.0.0.1.

Tests point the real huggingface_hub client at it and look at what arrived:

    with HubStandIn(tokens={"hf_good": {"user": "alice", "orgs": ["alice-org"]}}) as hub:
        point_hub_client_at(hub, monkeypatch)
        api = HfApi(endpoint=hub.url, token="hf_good")
        api.create_repo("alice/tiny", private=True)
        api.upload_folder(repo_id="alice/tiny", folder_path=export_dir)
        assert hub.repos["alice/tiny"]["files"]["model.safetensors"] == ...

It serves the routes a push and a download use with Xet off (whoami, repo create,
validate-yaml, preupload, the LFS batch/upload/verify, commit, repo info, tree,
paths-info, resolve), for model and dataset repos, one branch ("main"): enough for
`datasets.load_dataset_builder` on a dataset repo too. Answers, status codes and error
headers follow the real Hub where the client looks at them; see the comments.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import sys
import threading
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

REPO = r"(?P<repo>[^/]+/[^/]+?)"
# Files the Hub stores in LFS: by extension (its default .gitattributes) or by size.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".msgpack", ".png", ".jpg", ".zip")
LFS_MIN_SIZE = 10 * 1024 * 1024


@dataclass
class RecordedRequest:
    method: str
    path: str  # with the query string
    headers: dict[str, str]
    body: bytes


class HubError(Exception):
    """An error answer: JSON {"error": message}, and the X-Error-* headers hf_raise_for_status reads."""

    def __init__(self, status: int, message: str, code: str | None = None, body: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.body = status, message, {"error": message, **(body or {})}
        self.headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}


def git_blob_sha1(data: bytes) -> str:
    """The oid git (and the Hub's preupload answer) gives a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    """The server and its state. `tokens` maps a token to {"user", "orgs", "role" ("write" by default)}.

    State to inspect: `repos` (model repo_id -> {"private", "gated", "files": {path: bytes},
    "lfs_paths", "commits": [{"oid", "summary", "description", "paths", "files"}]}), `datasets`
    (dataset repo_id -> the same), `lfs_objects`
    (sha256 -> bytes), `requests` (every RecordedRequest, in order) and `errors` (tracebacks
    of requests the stand-in itself could not handle, answered with a 400). Set `fail_next_commit = True`
to answer the next commit with a 500, and a repo's "gated" to True to refuse its files to anyone
outside its namespace (401 GatedRepo, as the Hub answers a gated repo without granted access).
    """

    def __init__(self, tokens: dict[str, dict] | None = None):
        self.tokens = tokens or {}
        self.repos: dict[str, dict] = {}
        self.datasets: dict[str, dict] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[RecordedRequest] = []
        self.errors: list[str] = []
        self.fail_next_commit = False
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # a short poll: shutdown() waits for the server loop's next look, 0.5 s by default
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-standin", daemon=True)
        self._routes = [
            ("GET", r"/", lambda request: (200, b"", {})),  # the home page, which the doctor's check asks
            ("GET", r"/api/whoami-v2", self._whoami),
            ("POST", r"/api/repos/create", self._create_repo),
            ("POST", r"/api/validate-yaml", lambda request: {"errors": [], "warnings": []}),
        ]
        # the same routes for model and dataset repos: /api/models/... and /api/datasets/...,
        # /alice/x/resolve/... and /datasets/alice/x/resolve/...
        for kind, api, prefix in (("model", "/api/models", ""), ("dataset", "/api/datasets", "/datasets")):
            self._routes += [(method, pattern, functools.partial(action, kind=kind)) for method, pattern, action in [
                ("POST", rf"{api}/{REPO}/preupload/(?P<rev>[^/]+)", self._preupload),
                ("POST", rf"{api}/{REPO}/commit/(?P<rev>[^/]+)", self._commit),
                ("GET", rf"{api}/{REPO}/tree/(?P<rev>[^/?]+)(?:/(?P<folder>.+))?", self._tree),
                ("POST", rf"{api}/{REPO}/paths-info/(?P<rev>[^/]+)", self._paths_info),
                ("GET", rf"{api}/{REPO}(?:/revision/(?P<rev>[^/]+))?", self._repo_info),
                ("POST", rf"{prefix}/{REPO}\.git/info/lfs/objects/batch", self._lfs_batch),
                ("GET", rf"{prefix}/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self._resolve),
            ]]
        self._routes += [
            ("PUT", r"/lfs/upload/(?P<oid>[0-9a-f]{64})", self._lfs_put),
            ("POST", r"/lfs/verify/(?P<oid>[0-9a-f]{64})", self._lfs_verify),
        ]

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # --- dispatch -------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes):
        """-> (status, JSON-able or bytes, extra headers). Called by the handler, one request at a time."""
        with self._lock:
            request = RecordedRequest(method, raw_path, headers, body)
            self.requests.append(request)
            path = urlsplit(raw_path).path
            for route_method, pattern, action in self._routes:
                match = re.fullmatch(pattern, path)
                # HEAD is answered like GET, the handler leaves the body out
                if match and route_method == ("GET" if method == "HEAD" else method):
                    args = {key: unquote(value) for key, value in match.groupdict().items() if value is not None}
                    try:
                        answer = action(request, **args)
                    except HubError as error:
                        return error.status, error.body, error.headers
                    except Exception as error:  # a request this stand-in does not understand: say so, keep it
                        self.errors.append(traceback.format_exc())
                        return 400, {"error": f"HubStandIn could not handle {method} {path}: {error!r}"}, {}
                    return answer if isinstance(answer, tuple) else (200, answer, {})
            return 404, {"error": f"HubStandIn has no route for {method} {path}"}, {}

    # --- who is asking --------------------------------------------------------------

    def _caller(self, request: RecordedRequest, required: bool) -> dict | None:
        """The token's account, None when no token was sent; 401 for an unknown token, as the Hub does."""
        auth = next((v for k, v in request.headers.items() if k.lower() == "authorization"), None)
        if auth is None:
            if required:
                raise HubError(401, "Invalid credentials in Authorization header")
            return None
        account = self.tokens.get(auth.removeprefix("Bearer ").strip())
        if account is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return account

    def _writer(self, request: RecordedRequest, namespace: str, kind: str = "model") -> dict:
        account = self._caller(request, required=True)
        if namespace not in _namespaces(account) or account.get("role", "write") != "write":
            raise HubError(403, f"You don't have the rights to create a {kind} under the namespace \"{namespace}\"")
        return account

    def _store(self, kind: str) -> dict[str, dict]:
        return self.repos if kind == "model" else self.datasets

    def _repo(self, request: RecordedRequest, repo_id: str, write: bool = False, kind: str = "model") -> dict:
        if write:
            self._writer(request, repo_id.split("/")[0], kind)
        account = self._caller(request, required=False)
        repo = self._store(kind).get(repo_id)
        allowed = account is not None and repo_id.split("/")[0] in _namespaces(account)
        if repo is None or (repo["private"] and not allowed):
            # the Hub does not tell a private repo from a missing one
            raise HubError(404, "Repository not found", code="RepoNotFound")
        return repo

    # --- routes ---------------------------------------------------------------------

    def _whoami(self, request):
        account = self._caller(request, required=True)
        orgs = [{"name": org, "type": "org"} for org in account.get("orgs", [])]
        role = account.get("role", "write")
        auth = {"type": "access_token", "accessToken": {"displayName": "stand-in", "role": role}}
        return {"type": "user", "name": account["user"], "fullname": account["user"], "orgs": orgs, "auth": auth}

    def _create_repo(self, request):
        # 2.4.0 sends {"name", "organization" (None for the caller's own namespace), "visibility", "type"}
        wanted = json.loads(request.body)
        kind = wanted.get("type") or "model"
        if kind not in ("model", "dataset"):
            raise HubError(400, f"HubStandIn serves model and dataset repos, not {kind}")
        namespace = wanted.get("organization") or self._caller(request, required=True)["user"]
        self._writer(request, namespace, kind)
        repo_id = f"{namespace}/{wanted['name']}"
        url = f"{self.url}/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
        if repo_id in self._store(kind):
            # create_repo(exist_ok=True) reads "url" from this 409 answer
            raise HubError(409, f"You already created this {kind} repo", body={"url": url})
        private = wanted.get("visibility", "private" if wanted.get("private") else "public") == "private"
        self._store(kind)[repo_id] = {"private": private, "gated": False, "files": {}, "lfs_paths": set(),
                                      "commits": []}
        return {"url": url, "name": repo_id, "id": repo_id}

    def _check_rev(self, repo: dict, rev: str | None) -> dict:
        """The files at `rev` ("main" or a commit oid)."""
        if rev in (None, "main"):
            return repo["files"]
        for commit in repo["commits"]:
            if commit["oid"] == rev:
                return commit["files"]
        raise HubError(404, f"Invalid rev id: {rev}", code="RevisionNotFound")

    def _preupload(self, request, repo: str, rev: str, kind: str):
        target = self._repo(request, repo, write=True, kind=kind)
        files = self._check_rev(target, rev)
        answers = []
        for file in json.loads(request.body)["files"]:
            path, size = file["path"], file["size"]
            lfs = size > 0 and (path.lower().endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE)
            # the oid of the file already there lets the client skip unchanged files
            oid = None
            if path in files:
                existing = files[path]
                oid = hashlib.sha256(existing).hexdigest() if path in target["lfs_paths"] else git_blob_sha1(existing)
            answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return {"files": answers, "commitOid": _head(target)}

    def _lfs_batch(self, request, repo: str, kind: str):
        self._repo(request, repo, write=True, kind=kind)
        objects = []
        for obj in json.loads(request.body)["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs_objects:  # no "actions": the client skips what the store has
                answer["actions"] = {
                    "upload": {"href": f"{self.url}/lfs/upload/{obj['oid']}", "header": {}},
                    "verify": {"href": f"{self.url}/lfs/verify/{obj['oid']}", "header": {}},
                }
            objects.append(answer)
        return {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def _lfs_put(self, request, oid: str):
        # like a presigned S3 URL: the client sends no Authorization header here
        if hashlib.sha256(request.body).hexdigest() != oid:
            raise HubError(400, f"The uploaded content does not match its oid {oid}")
        self.lfs_objects[oid] = request.body
        return 200, b"", {"ETag": f'"{oid}"'}

    def _lfs_verify(self, request, oid: str):
        self._caller(request, required=True)
        if oid not in self.lfs_objects or len(self.lfs_objects[oid]) != json.loads(request.body).get("size"):
            raise HubError(404, f"LFS object {oid} was not uploaded")
        return {"success": True}

    def _commit(self, request, repo: str, rev: str, kind: str):
        target = self._repo(request, repo, write=True, kind=kind)
        if rev != "main":
            raise HubError(404, f"HubStandIn only commits to main, not {rev}", code="RevisionNotFound")
        if self.fail_next_commit:
            self.fail_next_commit = False
            raise HubError(500, "Internal Error - simulated by HubStandIn")
        lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
        files, lfs_paths, paths = dict(target["files"]), set(target["lfs_paths"]), []
        for line in lines[1:]:  # applied to copies, so a bad line leaves the repo as it was
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
                lfs_paths.discard(value["path"])
            elif key == "lfsFile":
                if value["oid"] not in self.lfs_objects:
                    raise HubError(422, f"LFS file {value['path']} ({value['oid']}) was never uploaded")
                files[value["path"]] = self.lfs_objects[value["oid"]]
                lfs_paths.add(value["path"])
            elif key in ("deletedFile", "deletedFolder"):
                gone = [p for p in files if p == value["path"] or p.startswith(value["path"].rstrip("/") + "/")]
                if not gone:
                    raise HubError(404, "A file with this name doesn't exist", code="EntryNotFound")
                for path in gone:
                    files.pop(path)
                    lfs_paths.discard(path)
            else:
                raise HubError(400, f"HubStandIn does not handle commit lines of kind {key!r}")
            paths.append(value["path"])
        oid = hashlib.sha1(f"{repo}:{len(target['commits'])}:{header.get('summary')}".encode()).hexdigest()
        target["files"], target["lfs_paths"] = files, lfs_paths
        target["commits"].append({
            "oid": oid, "summary": header.get("summary"), "description": header.get("description"),
            "paths": paths, "files": files,
        })
        return {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True,
                "pullRequestUrl": None}

    def _repo_info(self, request, repo: str, kind: str, rev: str | None = None):
        target = self._repo(request, repo, kind=kind)
        files = self._check_rev(target, rev)
        siblings = [{"rfilename": path} for path in sorted(files)]
        return {"id": repo, **({"modelId": repo} if kind == "model" else {}), "author": repo.split("/")[0],
                "sha": _head(target, rev), "private": target["private"], "gated": target["gated"] and "auto",
                "siblings": siblings, "tags": []}

    def _entry(self, target: dict, path: str, files: dict) -> dict:
        """A tree entry, as the tree and paths-info answers give it: a file, or a folder holding files."""
        if path not in files:
            return {"type": "directory", "path": path, "oid": hashlib.sha1(path.encode()).hexdigest()}
        data = files[path]
        entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
        if path in target["lfs_paths"]:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _tree(self, request, repo: str, rev: str, kind: str, folder: str = ""):
        """The entries under `folder`: its children, or with ?recursive=true everything below it,
        folders included (HfFileSystem globs over these; snapshot_download keeps the files)."""
        target = self._repo(request, repo, kind=kind)
        files = self._check_rev(target, rev)
        recursive = parse_qs(urlsplit(request.path).query).get("recursive", ["false"])[0].lower() == "true"
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        if prefix and not any(path.startswith(prefix) for path in files):
            raise HubError(404, f"{folder} does not exist on {rev}", code="EntryNotFound")
        found = set()
        for path in (p for p in files if p.startswith(prefix)):
            parts = path[len(prefix):].split("/")
            depth = len(parts) if recursive else 1
            found.update(prefix + "/".join(parts[:n]) for n in range(1, depth + 1))
        return [self._entry(target, path, files) for path in sorted(found)]

    def _paths_info(self, request, repo: str, rev: str, kind: str):
        """The entries for the asked paths (form field `paths`, repeated) that exist; others are left out."""
        target = self._repo(request, repo, kind=kind)
        files = self._check_rev(target, rev)
        asked = parse_qs(request.body.decode()).get("paths", [])
        return [self._entry(target, path.strip("/"), files) for path in asked
                if path.strip("/") in files or any(p.startswith(path.strip("/") + "/") for p in files)]

    def _resolve(self, request, repo: str, rev: str, path: str, kind: str):
        target = self._repo(request, repo, kind=kind)
        files = self._check_rev(target, rev)
        # hf_hub_download needs X-Repo-Commit and an ETag, and checks the size against Content-Length
        commit = {"X-Repo-Commit": _head(target, rev) or ""}
        if target["gated"] and not self._granted(request, repo):
            raise HubError(401, f"Access to {kind} {repo} is restricted. You must have access to it and be "
                           "authenticated to access it. Please log in.", code="GatedRepo", headers=commit)
        if path not in files:
            raise HubError(404, "Entry not found", code="EntryNotFound", headers=commit)
        data = files[path]
        lfs = path in target["lfs_paths"]
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        answer = {**commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        # a range of bytes, as the Hub's file servers give it (get_safetensors_metadata reads a header so)
        asked = next((v for k, v in request.headers.items() if k.lower() == "range"), "")
        span = re.fullmatch(r"bytes=(\d+)-(\d*)", asked.strip())
        if span and int(span[1]) < len(data):
            first, last = int(span[1]), min(int(span[2] or len(data) - 1), len(data) - 1)
            answer["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            return 206, data[first:last + 1], answer
        return 200, data, answer

    def _granted(self, request, repo: str) -> bool:
        account = self._caller(request, required=False)
        return account is not None and repo.split("/")[0] in _namespaces(account)


def _namespaces(account: dict) -> list[str]:
    return [account["user"], *account.get("orgs", [])]


def _head(repo: dict, rev: str | None = None) -> str | None:
    if rev not in (None, "main"):
        return rev
    return repo["commits"][-1]["oid"] if repo["commits"] else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

    def _serve(self):
        headers = dict(self.headers.items())
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = self._read_chunked()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, payload, extra = self.server.hub.handle(self.command, self.path, headers, body)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        if not isinstance(payload, bytes):
            self.send_header("Content-Type", "application/json")
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _read_chunked(self) -> bytes:
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()  # the blank line after the last chunk
        return b"".join(chunks)

    do_GET = do_HEAD = do_POST = do_PUT = _serve

    def log_message(self, format, *args):
        """Quiet: the stand-in's own `requests` list is the log."""


def point_hub_client_at(hub: HubStandIn, monkeypatch) -> None:
    """Make huggingface_hub, already imported, talk to `hub` for this test only.

    huggingface_hub 2.4.0 reads HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_DISABLE_XET once, at
    import (constants.py), so setting the variables in a test is not enough: the constants are
    patched too. The tests' conftest sets HF_HUB_OFFLINE=1, which blocks every request;
    Xet uploads cannot be served here. The module-level HfApi (behind ModelCard.push_to_hub and
    the bare upload_file) was made at import with the real endpoint, so it is pointed here too.
    """
    from huggingface_hub import constants, hf_api

    for name, value in {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_api.api, "endpoint", hub.url)
    # datasets keeps its own copies of the offline switch and the endpoint, also read at its import
    if "datasets.config" in sys.modules:
        config = sys.modules["datasets.config"]
        monkeypatch.setattr(config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(config, "HF_ENDPOINT", hub.url)
        monkeypatch.setattr(config, "HUB_DATASETS_URL", hub.url + "/datasets/{repo_id}/resolve/{revision}/{path}")


def use_hub_cache(folder, monkeypatch) -> None:
    """An empty Hugging Face cache in `folder` for this test: for the run's processes (HF_HUB_CACHE)
    and for this one (the constant, read at import), so that the checks made before launch, which
    fetch a model's config.json, never write into the user's own cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))


@functools.lru_cache(maxsize=None)
def header_only_safetensors(model_type: str) -> bytes:
    """A model.safetensors of the model_type's default model, its header alone: each tensor's name
    and shape (from the model built on the meta device), no data. The studio reads a Hub model's
    headers before launch; a big model's weights need not be made for that."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        size = tensor.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw
