"""The compile cache panel in a real browser: it shows the cache, refuses to clear it while
a real run is going, and clears it once the run has stopped. (What a real compile leaves
in the cache is checked in test_compile_cache.py.)"""

from __future__ import annotations

from studio_core.hardware import cpu_hardware
from studio_core.runs.manager import RunManager
from studio_core.spec import RunSpec
from studio_browser import browser, new_page, pytestmark, runs_dir  # noqa: F401 (fixtures)
from studio_browser import App, ROOT, expect


def test_the_runs_tab_shows_and_clears_the_compile_cache(new_page, runs_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_COMPILE_CACHE", str(tmp_path / "cc"))  # the app inherits it
    entry = tmp_path / "cc" / "cpu" / "inductor" / "fxgraph" / "ab" / "key" / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"x" * 2048)
    app = App(runs_dir)  # an app of its own: it reads the compile cache named above
    try:
        page = new_page(app.url)
        page.get_by_role("tab", name="Runs").click()
        page.get_by_text("Compile cache").click()
        panel = page.locator("#compile-cache")
        expect(panel).to_contain_text(str(tmp_path / "cc" / "cpu"))
        expect(panel).to_contain_text("Inductor FX graphs")
        expect(panel).to_contain_text("2.0 KB")
        page.screenshot(path=str(tmp_path / "compile-cache.png"), full_page=True)

        spec = RunSpec.load(ROOT / "recipes" / "tiny-sft.yaml").with_overrides(["max_steps=3000"])
        manager = RunManager(runs_dir)
        view = manager.start(spec, cpu_hardware())
        page.locator("#clear-compile-cache").click()
        expect(panel).to_contain_text("Not cleared")
        expect(panel).to_contain_text(view.id)
        assert entry.exists()

        manager.stop(view.id)
        page.locator("#clear-compile-cache").click()
        expect(panel).to_contain_text("Cleared.")
        expect(panel).to_contain_text("0 B")
        assert not entry.exists()
    finally:
        app.kill()
