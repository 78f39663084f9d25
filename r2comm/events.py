"""Event logging: the engine's failover events, logged (R2COMM_DEBUG=INFO) and handed to the
callbacks registered with Communicator.on_event, from the links thread."""
import logging

log = logging.getLogger("r2comm")


def flush(world):
    """Log the events new since the last flush and hand them to the world's callbacks."""
    if world.closed:
        return []
    new = world.engine.events_since(world.event_cursor)
    if new:                          # (the engine keeps the last events only: numbered)
        world.event_cursor = new[-1]["index"] + 1
    for ev in new:
        if world.cfg.debug in ("INFO", "DEBUG"):
            log.warning("r2comm rank %d: %s peer=%s rail=%s detector=%s bytes=%s cause=%s %s",
                        ev["rank"], ev["kind"], ev["peer"], ev["rail"], ev["detector"],
                        ev["nbytes"], ev.get("cause"), ev["info"])
        for cb in world.callbacks:
            try:
                cb(ev)
            except Exception:                       # a callback must not kill the engine
                log.exception("r2comm event callback failed")
    return new
