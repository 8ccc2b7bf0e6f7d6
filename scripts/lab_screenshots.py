#!/usr/bin/env python
"""Screenshots of the inference lab's four views, for the README: docs/img/lab_*.png.

    python scripts/lab_screenshots.py                     # SmolLM2-135M-Instruct, Debian's chromium
    python scripts/lab_screenshots.py --model tiny.gguf --chromium /path/to/chrome --out /tmp/shots

It serves the model in this process (as scripts/serve.py would, on a free 127.0.0.1 port), opens /lab in headless
Chromium driven by Playwright, and does what a learner would: a greedy chat generation, a click on one of its
tokens, four requests at once, the seed's 7B shape in the calculator at a batch that does not fit. Needs the serve
and lab extras (pip install -e ".[serve,lab]") and a Chromium (apt-get install chromium). The timings in the
pictures are whatever this machine did while it ran: illustrative, not measurements.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tinyllm  # noqa: E402

PROMPT = "What is the capital of France?"
LAUNCH_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def start_server(server) -> tuple[str, object]:
    """Run the Server on a free 127.0.0.1 port in a thread of this process. -> (its URL, the uvicorn server)."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 300                       # the first start compiles the kernels
    while not (uv.started and server.loop.ready.is_set()):
        if server.loop.error is not None or time.monotonic() > deadline:
            raise SystemExit(f"error: the server did not start: {server.loop.error!r}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", uv


def shrink(path: Path) -> None:
    """Re-save as a 256-colour PNG (a third of the size; the page is flat colours) when Pillow is there."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256)
    small.save(path, optimize=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=str(ROOT / "docs" / "img"), help="directory for the PNG files")
    p.add_argument("--chromium", default=os.environ.get("TINYLLM_CHROMIUM") or shutil.which("chromium"),
                   help="the Chromium executable (default: $TINYLLM_CHROMIUM, else chromium on the PATH)")
    p.add_argument("--width", type=int, default=1200, help="page width in pixels")
    args = p.parse_args(argv)
    try:
        from playwright.sync_api import sync_playwright
        from tinyllm.server import ServerOptions, build_app
    except ImportError as e:
        print(f"error: needs the serve and lab extras ({e.name} is missing): pip install -e \".[serve,lab]\"",
              file=sys.stderr)
        return 2
    if not args.chromium:
        print("error: no Chromium found: apt-get install chromium, or pass --chromium PATH", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = tinyllm.load(args.model)
    server = build_app(model, ServerOptions(model_name=Path(args.model).stem if args.model else
                                            "SmolLM2-135M-Instruct"), kv_memory="64MiB", max_num_seqs=8)
    url, uv = start_server(server)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": 900})
        page.goto(url + "/lab")
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        page.add_style_tag(content="header { position: static; }")   # a sticky header would cover the shots

        def shot(section: str, name: str) -> None:
            path = out / f"lab_{name}.png"
            page.locator(f"section#{section}").screenshot(path=str(path))
            shrink(path)
            print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")

        # 1. a greedy chat generation
        page.fill("#prompt", PROMPT)
        page.fill("#max-tokens", "40")
        page.click("#go")
        page.wait_for_selector("#gen-text[data-done=true]", timeout=120_000)
        shot("generate", "generate")
        # 2. look inside the token that names the city (or the third one)
        boxes = page.locator("#tokens .tok")
        texts = [boxes.nth(i).get_attribute("data-text") for i in range(boxes.count())]
        pick = next((i for i, t in enumerate(texts) if "Paris" in t), min(2, len(texts) - 1))
        boxes.nth(pick).click()
        page.wait_for_selector("#att-row .att", timeout=300_000)
        shot("inside", "inside")
        # 3. four requests at once, caught while they run
        page.fill("#eng-n", "4")
        page.fill("#eng-max", "64")
        page.click("#eng-send")
        page.wait_for_function("document.querySelectorAll('#running .card').length >= 3 && "
                               "document.querySelectorAll('#timeline .tl-cell.tok').length >= 60", timeout=120_000)
        shot("engine", "engine")
        page.wait_for_function("document.querySelectorAll('#running .card').length === 0", timeout=300_000)
        # 4. the seed's 7B shape at a 4k context and batch 64: 141 GiB on an 80 GiB device
        page.select_option("#calc-preset", "7b")
        page.fill("input[name=context]", "4096")
        page.fill("input[name=batch]", "64")
        page.wait_for_function("document.querySelector('#calc-verdict').dataset.fits === 'false'")
        shot("arithmetic", "arithmetic")
        browser.close()
    uv.should_exit = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
