"""What a user chooses for a Ray run: the cluster's address, the recipe's `studio.ray` block
(`launch.py train RECIPE --ray ADDRESS`). Its field's metadata (backends.base.option) is what the
command line makes its flag from and the form its widget."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from studio_core.backends.base import option, options_from_dict

KEY = "studio.ray"  # the recipe key the options are read from
# The address of a Ray cluster's Jobs API: its head's dashboard, http(s)://HOST:PORT (8265 by default);
# HOST a name, an IPv4 address or an IPv6 address in brackets.
ADDRESS = re.compile(r"https?://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)(?::(?P<port>\d+))?/?")
WRITE = ("write http://HOST:PORT, e.g. http://10.0.0.5:8265 (the head's dashboard, 8265 unless it was started "
         "with --dashboard-port)")


@dataclass
class RayOptions:
    address: str | None = option(None, label="Ray address", flag="--ray", placeholder="http://HEAD:8265",
                                 help="submit the run to the Ray cluster whose dashboard (Jobs API) is at ADDRESS, "
                                 "e.g. http://10.0.0.5:8265", recipe="the head's dashboard address, e.g. "
                                 "http://10.0.0.5:8265")

    @classmethod
    def from_dict(cls, data) -> tuple:
        """The options of a recipe's block, and what the dataclass cannot hold."""
        return options_from_dict(cls, KEY, data)

    def to_dict(self) -> dict:
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) != f.default}

    def settled(self) -> RayOptions:
        return self

    def check(self, labels: dict | None = None) -> list[str]:
        label = (labels or {}).get("address", f"{KEY}.address")
        if self.address is None:
            return []  # said by the backend's layout check, which knows whether the run goes to Ray
        matched = ADDRESS.fullmatch(self.address.strip()) if isinstance(self.address, str) else None
        if matched is None:
            ipv6 = " (an IPv6 host goes in brackets: http://[fd00::5]:8265)" if "[" in str(self.address) else ""
            return [f"{label}: {self.address!r} is not a Ray dashboard address: {WRITE}{ipv6}"]
        port = matched["port"]
        if port is not None and not 1 <= int(port) <= 65535:
            return [f"{label}: {self.address!r} is not a Ray dashboard address: port {port} is out of range (1 to "
                    f"65535): {WRITE}"]
        return []
