// The kernel's view of a rail, read only when the rail's acknowledgement deadline is near:
// is the peer's kernel still acknowledging TCP segments (its process is stalled, the NICs are
// fine), or has every acknowledgement stopped (a NIC or the path is dead)? And is the NIC that
// holds the rail's local address itself down? All of it without the GIL, from the engine.
#pragma once
#include <linux/tcp.h>      // struct tcp_info with tcpi_bytes_acked / notsent_bytes / snd_wnd
                            // (glibc's <netinet/tcp.h> stops at tcpi_total_retrans)
#include <linux/filter.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <net/if.h>
#include <ifaddrs.h>
#include <cstddef>
#include <cstdio>
#include <cstring>

struct r2_tcpsnap {
    int ok;                      // 1: TCP_INFO was read
    int has_acked, has_wnd;      // the kernel reports tcpi_bytes_acked / tcpi_snd_wnd
    unsigned state, unacked, probes, backoff, retransmits, total_retrans, snd_mss;
    unsigned last_ack_ms;        // since the last acknowledgement (any segment with an ACK)
    unsigned notsent;            // bytes queued in the kernel, not yet sent
    unsigned long long bytes_acked;
    unsigned long long snd_wnd;  // the peer's advertised receive window (bytes)
};

static inline int r2_tcp_snap(int fd, r2_tcpsnap* s) {
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    std::memset(s, 0, sizeof(*s));
    std::memset(&ti, 0, sizeof(ti));
    if (fd < 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return -1;
    s->ok = 1;
    s->state = ti.tcpi_state;
    s->unacked = ti.tcpi_unacked;
    s->probes = ti.tcpi_probes;
    s->backoff = ti.tcpi_backoff;
    s->retransmits = ti.tcpi_retransmits;
    s->total_retrans = ti.tcpi_total_retrans;
    s->snd_mss = ti.tcpi_snd_mss;
    s->last_ack_ms = ti.tcpi_last_ack_recv;
    s->has_acked = len >= offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof(ti.tcpi_bytes_acked);
    s->bytes_acked = ti.tcpi_bytes_acked;
    if (len >= offsetof(struct tcp_info, tcpi_notsent_bytes) + sizeof(ti.tcpi_notsent_bytes))
        s->notsent = ti.tcpi_notsent_bytes;
    s->has_wnd = len >= offsetof(struct tcp_info, tcpi_snd_wnd) + sizeof(ti.tcpi_snd_wnd);
    s->snd_wnd = ti.tcpi_snd_wnd;
    return 0;
}

// The interface holding address `ss` on this host: 1 up with carrier, 0 down or without
// carrier (its name in `name`), -1 not an address of this host (or unknown).
static inline int r2_ifaddr_state(const struct sockaddr_storage* ss, char* name, size_t n) {
    struct ifaddrs* all = nullptr;
    int res = -1;
    if (n)
        name[0] = 0;
    if (ss->ss_family != AF_INET && ss->ss_family != AF_INET6)
        return -1;
    if (getifaddrs(&all) != 0)
        return -1;
    for (struct ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
        if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != ss->ss_family)
            continue;
        bool same = ss->ss_family == AF_INET
            ? ((struct sockaddr_in*)a->ifa_addr)->sin_addr.s_addr == ((const struct sockaddr_in*)ss)->sin_addr.s_addr
            : std::memcmp(&((struct sockaddr_in6*)a->ifa_addr)->sin6_addr,
                          &((const struct sockaddr_in6*)ss)->sin6_addr, sizeof(struct in6_addr)) == 0;
        if (!same)
            continue;
        if (n)
            std::snprintf(name, n, "%s", a->ifa_name);
        res = (a->ifa_flags & IFF_UP) && (a->ifa_flags & IFF_RUNNING) ? 1 : 0;
        break;
    }
    freeifaddrs(all);
    return res;
}

// The interface holding IPv4 address `addr` (dotted quad) on this host, as r2_ifaddr_state: 1 up
// with carrier, 0 down or without carrier, -1 not an address of this host (or not IPv4).
static inline int r2_addr_state(const char* addr, char* name, size_t n) {
    struct sockaddr_storage ss;
    std::memset(&ss, 0, sizeof(ss));
    struct sockaddr_in* sin = (struct sockaddr_in*)&ss;
    sin->sin_family = AF_INET;
    if (n)
        name[0] = 0;
    if (inet_pton(AF_INET, addr, &sin->sin_addr) != 1)
        return -1;
    return r2_ifaddr_state(&ss, name, n);
}

// The interface that holds fd's local address: 1 up with carrier, 0 down or without carrier
// (its name in `name`), -1 unknown.
static inline int r2_local_nic(int fd, char* name, size_t n) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (n)
        name[0] = 0;
    if (fd < 0 || getsockname(fd, (struct sockaddr*)&ss, &sl) != 0)
        return -1;
    return r2_ifaddr_state(&ss, name, n);
}

// 1 if the connection's peer address is one of this host's own (its bytes never leave the
// host: two ranks of one host on a rail address go through the kernel's local route, also while
// that NIC is down), 0 if not, -1 if unknown.
static inline int r2_peer_local(int fd) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (fd < 0 || getpeername(fd, (struct sockaddr*)&ss, &sl) != 0)
        return -1;
    if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6)
        return -1;
    return r2_ifaddr_state(&ss, nullptr, 0) >= 0 ? 1 : 0;
}

// Make a connection's NIC look dead to both kernels (the injected silent fault): a socket
// filter that drops every incoming segment before TCP sees it, so this kernel acknowledges
// nothing more and the peer's TCP_INFO shows no progress, as behind a dead link.
static inline int r2_drop_input(int fd) {
    struct sock_filter code[1] = {{BPF_RET | BPF_K, 0, 0, 0}};   // keep 0 bytes: drop
    struct sock_fprog prog;
    prog.len = 1;
    prog.filter = code;
    return fd < 0 ? -1 : setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &prog, sizeof(prog));
}
