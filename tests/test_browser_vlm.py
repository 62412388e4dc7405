"""Vision-language data in a real browser: Check dataset on builtin:shapes shows its first rows'
images as captioned thumbnails (and its image column as file names), a text dataset after it hides
them again, a run of the tiny vision-language model started from the page finishes, and the Chat
tab sends an image with a message to the session's trained VLM run (conftest.vlm_runs).

Chromium through Playwright, the app as its own process, one app for this file
(tests/studio_browser.py); skipped, saying so, where Chromium is missing.
"""

from __future__ import annotations

from studio_browser import app, app_env, browser, new_page, page, pytestmark  # noqa: F401 (fixtures)
from studio_browser import expect, run_state, set_number


def pick(page, elem_id: str, value: str) -> None:
    """Type a value into one of the form's dropdowns (the model's, the dataset's), as a user does."""
    box = page.locator(f"#{elem_id} input").first
    box.fill(value)
    box.press("Enter")
    expect(box).to_have_value(value)


def loaded_images(gallery) -> list[int]:
    """The natural widths of the gallery's thumbnails (0: an image that did not load)."""
    return gallery.locator("img").evaluate_all("imgs => imgs.map(img => img.complete ? img.naturalWidth : 0)")


def test_check_dataset_shows_a_vision_datasets_images_and_a_text_dataset_hides_them(page):
    pick(page, "model", "builtin:tiny-vlm")
    pick(page, "dataset", "builtin:shapes")
    page.get_by_text("Dataset: upload, Hub options").click()
    page.locator("#check-dataset").click()
    report, gallery = page.locator("#data-report"), page.locator("#data-images")
    expect(report).to_contain_text("with images in images")
    expect(report).to_contain_text("Fits SFT")
    expect(gallery).to_be_visible()
    expect(gallery.locator("img")).to_have_count(6)
    page.wait_for_function("() => { const imgs = [...document.querySelectorAll('#data-images img')];"
                           " return imgs.length === 6 && imgs.every(img => img.complete && img.naturalWidth > 0); }")
    assert all(width > 0 for width in loaded_images(gallery))
    for number in range(1, 7):  # each captioned with its row and the row's first user text
        expect(gallery).to_contain_text(f"row {number}: ")
    expect(gallery).to_contain_text("row 1: Describe the image.")
    # the preview names the image files, not a list's repr
    preview = page.locator("#data-preview")
    expect(preview).to_contain_text("0652.png")
    assert "['images/" not in preview.inner_text()

    pick(page, "dataset", "builtin:qa")
    pick(page, "model", "builtin:tiny-qwen3")
    page.locator("#check-dataset").click()
    expect(report).not_to_contain_text("with images")
    expect(report).to_contain_text("Fits SFT")
    expect(gallery).to_be_hidden()


def test_a_vision_language_run_started_from_the_page_finishes(page, app):
    pick(page, "model", "builtin:tiny-vlm")
    pick(page, "dataset", "builtin:shapes")
    set_number(page, "max_steps", 10)
    page.locator("#start").click()
    run_state(page, "FINISHED").wait_for(timeout=120_000)
    [view] = app.new_runs()
    assert view.live_state == "finished"
    assert view.spec["model_name_or_path"] == "builtin:tiny-vlm" and view.spec["dataset_name"] == "builtin:shapes"


def test_the_chat_tab_shows_an_image_with_the_message_and_answers_as_plain_transformers(page, app, vlm_runs):
    """Issue 49: the image box appears for a vision-language run; the image goes with the message,
    shows in the conversation, and the answer is plain Transformers' to that image."""
    from test_browser_chat_export import load_in_chat
    from test_vlm_chat import held_out, plain_answers

    vlm_runs.copy_to(app.runs_dir, "full")
    run_id = vlm_runs.ids["full"]
    (question, image), = held_out(1)
    [expected] = plain_answers(app.runs_dir / run_id / "output", [(question, image)], new_tokens=128)
    load_in_chat(page, run_id)
    expect(page.locator("#chat-status")).to_contain_text("A vision-language model: give it an image")
    picture = page.locator("#chat-image")
    expect(picture).to_be_visible()
    picture.locator("input[type=file]").set_input_files(str(image))
    expect(picture.locator("img")).to_be_visible()
    box = page.locator("#chat-input textarea").first
    box.fill(question)
    box.press("Enter")
    tuned = page.locator("#chat-tuned")
    expect(tuned).to_contain_text(expected, timeout=60_000)
    expect(page.locator("#chat-shapes")).to_contain_text("tokens in")
    shown = tuned.locator("img")
    expect(shown).to_have_count(1)  # the image, in the user's bubble
    page.wait_for_function("() => [...document.querySelectorAll('#chat-tuned img')].every("
                           "img => img.complete && img.naturalWidth > 0)")
    expect(picture.locator("img")).to_have_count(0)  # the box is empty again for the next message
