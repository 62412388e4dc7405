"""The studio's Gradio UI: turns widget values into studio_core calls, and shows runs."""
