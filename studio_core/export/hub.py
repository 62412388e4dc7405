"""Push an exported folder to the Hugging Face Hub in one commit, with a token never stored.

The token comes from the field the user typed it into (for this push only), else from
HF_TOKEN, else from the login huggingface_hub already saved; it lives in this process's
memory for the push and is never written, logged, or put in a run folder, an event, a
recipe, an export or a card by the studio. Every failure (a wrong or expired token, a
read-only token, a namespace the token cannot write to, a repo that exists, no network,
offline mode) becomes a HubError that says what to change, and says what state the
push left on the Hub. The card goes up naming the repo it is pushed to in its usage code
(the export folder itself keeps its placeholder).
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id
from httpx2 import HTTPError

from studio_core.export.export import card_for_repo


class HubError(ValueError):
    """The push cannot be made or did not complete; the message says what to change."""


def resolve_token(typed: str | None, can_type: bool = True) -> tuple[str, str]:
    """(token, where it came from, for messages): typed, HF_TOKEN, or the saved login.
    `can_type`: the asker has a token field (the page); the command line has none."""
    if typed and typed.strip():
        return typed.strip(), "the token typed for this push"
    token = get_token()  # HF_TOKEN first, then huggingface_hub's token file
    if token:
        return token, "HF_TOKEN" if os.environ.get("HF_TOKEN") else "your saved Hugging Face login"
    typing = "type one for this push, " if can_type else ""
    raise HubError(f"no Hub token: {typing}set HF_TOKEN, or log in once with `hf auth login`")


def push(folder: str | Path, repo_id: str, token: str, source: str = "the token", private: bool = True,
         update: bool = False) -> str:
    """Create the repo (private by default) and upload the folder in one commit; the repo's URL."""
    folder, repo_id = Path(folder), repo_id.strip()
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubError(f"repo id {repo_id!r}: {error} (write it as your-name/model-name)") from None
    if "/" not in repo_id:
        raise HubError(f"repo id {repo_id!r}: write it as your-name/{repo_id} or an-org/{repo_id}")
    if not (folder / "README.md").exists():
        raise HubError(f"{folder} is not an export (no README.md model card): export the run first")
    api = HfApi(token=token)
    url = f"{constants.ENDPOINT}/{repo_id}"
    with _explained(token, source, repo_id, "checking the token"):
        me = api.whoami()
    _check_rights(me, repo_id, source)
    created = False
    with _explained(token, source, repo_id, "creating the repo"):
        if not update and api.repo_exists(repo_id):
            raise HubError(f"{url} already exists: choose another repo id, or push as an update of it "
                           "(a new commit on top of what is there)")
        created = not api.repo_exists(repo_id)
        api.create_repo(repo_id, private=private, exist_ok=update)
    state = "the repo was created and is still empty" if created else "the repo keeps its files as they were"
    with _explained(token, source, repo_id, f"uploading ({state}; nothing of this export was committed: "
                                            "push again, as an update)"):
        api.create_commit(repo_id, _files(folder, repo_id),
                          commit_message=f"Upload {folder.name} from the Trainium fine-tuning studio")
    return url


def _files(folder: Path, repo_id: str) -> list[CommitOperationAdd]:
    """The export's files as they are, but its card names the repo it goes to."""
    card = folder / "README.md"
    return [CommitOperationAdd("README.md", card_for_repo(card.read_text(), repo_id).encode())] + [
        CommitOperationAdd(path.relative_to(folder).as_posix(), str(path))
        for path in sorted(folder.rglob("*")) if path.is_file() and path != card]


def _check_rights(me: dict, repo_id: str, source: str) -> None:
    namespace = repo_id.split("/")[0]
    mine = {me.get("name"), *(org.get("name") for org in me.get("orgs", []))}
    if namespace not in mine:
        raise HubError(f"{source} belongs to {me.get('name')}, who cannot write to {namespace!r}: use one of "
                       f"{', '.join(sorted(filter(None, mine)))} as the repo's namespace, or another token")
    role = (me.get("auth", {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubError(f"{source} is read-only: make a token with write access ({constants.ENDPOINT}/settings/tokens)")


class _explained:
    """Turns huggingface_hub's errors into HubErrors that say what to change (never the token)."""

    def __init__(self, token: str, source: str, repo_id: str, doing: str):
        self.token, self.source, self.repo_id, self.doing = token, source, repo_id, doing

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or isinstance(error, HubError):
            return False
        if isinstance(error, OfflineModeIsEnabled):
            raise HubError("HF_HUB_OFFLINE is set in the studio's environment: start the studio without it "
                           "to push") from None
        if isinstance(error, HfHubHTTPError) and error.response is not None:
            raise HubError(self._http(error.response.status_code, str(error))) from None
        if isinstance(error, HTTPError):
            raise HubError(f"cannot reach {constants.ENDPOINT} while {self.doing}: check the network "
                           f"(or HF_ENDPOINT): {self._clean(str(error))}") from None
        return False

    def _http(self, status: int, text: str) -> str:
        if status == 401:
            return (f"{self.source} was refused by {constants.ENDPOINT} (wrong or expired): make a new token "
                    f"with write access at {constants.ENDPOINT}/settings/tokens")
        if status == 403:
            return f"{self.source} may not write to {self.repo_id}: no write access there ({self._clean(text)})"
        if status == 409:
            return f"{constants.ENDPOINT}/{self.repo_id} already exists: choose another repo id, or push as an update"
        return f"the Hub answered {status} while {self.doing}: {self._clean(text)}"

    def _clean(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text
