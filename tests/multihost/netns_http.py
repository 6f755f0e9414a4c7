"""A one-shot HTTP client run inside a host namespace (``ip netns exec <ns> python netns_http.py ...``): the test
process lives in the root namespace, which has no route to the test range. stdlib only; prints one JSON object.

    netns_http.py get HOST PORT PATH
    netns_http.py post HOST PORT PATH BODY_JSON       -> {"status": ..., "body": <JSON answer>}
    netns_http.py stream HOST PORT PATH BODY_JSON     -> {"status": ..., "text": <the streamed text>}
"""

from __future__ import annotations

import http.client
import json
import sys


def main(argv: list[str]) -> dict:
    verb, host, port, path = argv[0], argv[1], int(argv[2]), argv[3]
    conn = http.client.HTTPConnection(host, port, timeout=float(argv[5]) if len(argv) > 5 else 180.0)
    try:
        if verb == "get":
            conn.request("GET", path)
        else:
            conn.request("POST", path, body=argv[4], headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if verb != "stream" or resp.status != 200:
            raw = resp.read()
            try:
                return {"status": resp.status, "body": json.loads(raw)}
            except json.JSONDecodeError:
                return {"status": resp.status, "body": raw.decode(errors="replace")}
        parts = []
        for line in resp:
            data = line.strip()
            if not data.startswith(b"data:") or data[5:].strip() == b"[DONE]":
                continue
            for choice in json.loads(data[5:]).get("choices", []):
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return {"status": resp.status, "text": "".join(parts)}
    finally:
        conn.close()


if __name__ == "__main__":
    try:
        print(json.dumps(main(sys.argv[1:])))
    except (OSError, http.client.HTTPException) as exc:
        print(json.dumps({"status": 0, "error": f"{type(exc).__name__}: {exc}"}))
