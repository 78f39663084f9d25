"""One transport kind's cold path as one object: the Python counterpart of the C table in
r2comm/_core/transport.pxd, in the spirit of NCCL's ncclNet_t.

The hot table (adopt, event_fd, isend, test, irecv, ...) moves bytes without the GIL; this
object says everything else about the kind, and the control plane asks nothing of a kind but
this object (r2comm.transport.kind_of, CONTROL, LOCAL):

  offer / decide        what this rank can bring at bootstrap, and how the job settles on one
                        kind for its NIC rails (r2comm.transport.offer / decide)
  dial / attach         the opener's connection (after the TCP handshake every connection
                        starts with), and turning an authenticated socket into the engine's
                        connection: engine.links.attach (the built-in TCP table) or
                        engine.links.attach_transport (a table handed over by address)
  open                  local kinds only: the whole set-up of a pair's link
  hello_rails           the HELLO rail codes this kind's connections arrive with (beside data
                        rails 0..k and the control rail)
  attach_blocks         attach waits for the peer (a queue-pair exchange): not on the links
                        thread, which drives every other handshake
  rail_fds              fds one connection of this kind holds (the start-up fd budget)
  min_rail_timeout_ms   the shortest rail deadline the kind tolerates (0: no floor)
  registration_cache    the cache that registers user memory for zero-copy sends, or None
  prepare               before the engine (a crashed job's leftovers)

A new transport is one .pxd/.pxi (its table) plus one module here that defines a Transport
subclass and its TRANSPORT object, listed in r2comm/transport/__init__.py's KINDS."""


class Transport:
    """The defaults: a NIC kind without registration, floor or extra fds."""
    name = ""
    local = False            # links ranks of one host (no NIC under it)
    rail_fds = 1             # fds one data connection holds
    attach_blocks = False    # attach waits for the peer (run off the links thread)
    hello_rails = ()         # HELLO rail codes of this kind's own connections
    missing = "cannot run it"   # "rank r {missing}: why" when a job asks for this kind

    def offer(self, rail_addrs, cfg=None):
        """What this rank brings for its NIC rails (cfg: the settings, None for the kind's
        defaults): (devices or None, None), or (None, why this rank cannot run the kind)."""
        return None, None

    def min_rail_timeout_ms(self):
        return 0

    def prepare(self, cfg):
        """Before the engine starts (clean up what crashed jobs left)."""

    def registration_cache(self, boot, cfg):
        return None

    def dial(self, boot, cfg, peer, rail, timeout):
        """Open and authenticate the socket of connection (peer, rail) -> (fd, connection id).
        Raises OSError or HandshakeError."""
        raise NotImplementedError

    def attach(self, engine, boot, peer, rail, fd, conn_id, engine_rail):
        """Hand the authenticated socket fd (its keys still with the handshake) to the engine
        as connection (peer, engine_rail). On failure fd is closed and the error raised."""
        raise NotImplementedError

    def __repr__(self):
        return f"<r2comm transport {self.name}>"
