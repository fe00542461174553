"""Which files of the course one request crosses, from its HTTP body to its first token: a
``POST /generate`` for one new token, sent to the server's app with the engine in this process
(the files of ``engine_process.py``'s pipe are not seen from here: add it), every function
call of every thread recorded with ``sys.setprofile``. docs/request-flow.md quotes it.

    python scripts/request_path.py
"""

import asyncio
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def crossed() -> list[str]:
    """The course's files (relative to the repository) that one request's functions run in,
    in the order first called."""
    import httpx

    from helpers import load_model
    from helpers.server import Engine, create_app

    seen: dict[str, None] = {}                    # in the order first called
    recording = threading.Event()

    def profile(frame, event, arg):
        if event == "call" and recording.is_set():
            name = frame.f_code.co_filename
            if name.startswith(str(ROOT / "helpers")):
                seen.setdefault(str(Path(name).relative_to(ROOT)))

    threading.setprofile(profile)                 # every thread started from now on
    sys.setprofile(profile)
    model, tokenizer = load_model(device="cpu")
    engine = Engine(model, tokenizer, compile="off").start()
    app = create_app(engine, manage_engine=False)

    async def one_request():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            await client.get("/health")
            recording.set()
            reply = await client.post("/generate", json={
                "inputs": "Jack and Jill", "parameters": {"max_new_tokens": 1}})
            recording.clear()
            assert reply.status_code == 200, reply.text

    try:
        asyncio.run(one_request())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        engine.stop()
    return list(seen)


def main() -> None:
    seen = crossed()
    server = [f for f in seen if f.startswith("helpers/server/")]
    print(f"{len(server)} files of helpers/server (+ engine_process.py with --engine process):")
    for name in server:
        print("  " + name)
    print("and outside it:", ", ".join(f for f in seen if f not in server))


if __name__ == "__main__":
    main()
