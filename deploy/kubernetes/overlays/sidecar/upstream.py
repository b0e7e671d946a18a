"""The demo's legacy service: an orders store that trusts every write it receives.

It knows nothing about fencing tokens. PUT/POST/PATCH /orders/<id> stores the request body as
the order, DELETE removes it, GET returns it; every write is logged with the token palisade
forwarded, so `docker compose logs upstream` shows which writes reached it (a zombie's never
does). GET /healthz answers 200 for the compose health check. Standard library only.
"""

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ORDERS = {}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keep-alive, as palisade's upstream pool expects; every answer has a length.
    protocol_version = "HTTP/1.1"
    server_version = "legacy-orders/1"

    def body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def answer(self, status, text):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def write(self):
        body = self.body().decode(errors="replace")
        token = self.headers.get("x-fencing-token", "-")
        if not self.path.startswith("/orders/"):
            return self.answer(404, "no such collection\n")
        with LOCK:
            if self.command == "DELETE":
                ORDERS.pop(self.path, None)
            else:
                ORDERS[self.path] = body
        print(f"WRITE {self.command} {self.path} token={token} body={body!r}", flush=True)
        self.answer(200, f"stored {self.path}\n")

    do_PUT = do_POST = do_PATCH = do_DELETE = write

    def do_GET(self):
        if self.path == "/healthz":
            return self.answer(200, "ok\n")
        with LOCK:
            order = ORDERS.get(self.path)
        if order is None:
            return self.answer(404, "no such order\n")
        self.answer(200, order + "\n")

    do_HEAD = do_GET

    def log_message(self, format, *args):
        if self.path != "/healthz":
            sys.stderr.write("%s %s\n" % (self.address_string(), format % args))


if __name__ == "__main__":
    # usage: upstream.py [PORT [HOST]]; in the container, every interface on port 9000.
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
    host = sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0"
    print(f"legacy orders service on {host}:{port}", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()
