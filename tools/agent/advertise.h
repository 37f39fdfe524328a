// The control address an agent registers: where agents on other hosts reach its engine.
//
// An engine listening on a wildcard address (0.0.0.0, ::) accepts connections on every
// interface, but the wildcard is no destination: a peer given "0.0.0.0:7000" connects to its own
// host. So the registered host is, in order: the --advertise host; the --listen host when it is
// not a wildcard (prefill); otherwise the address of the interface this host uses toward the
// registry (a connected UDP socket's local address: the kernel picks the route, no packet is
// sent). The port is the --advertise port, or else the bound control port (prefill) or 0 (a
// decode engine accepts no connections).
//
// Thread safety: pure functions (OutgoingAddressToward opens and closes its own socket).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvt/common/status.h"

namespace kvt::tools {

struct Advertise {
  std::string host;
  std::optional<uint16_t> port;  // nullopt: the bound control port
};

// "HOST", "HOST:PORT", "[V6]" or "[V6]:PORT" (a bare IPv6 address without brackets is taken
// whole as the host). InvalidArgument naming the text when the host is empty or a wildcard, or
// the port is not in 1..65535.
StatusOr<Advertise> ParseAdvertise(const std::string& text);

// True for 0.0.0.0, :: and the empty host (what a server binds to, not a destination).
bool IsWildcardHost(const std::string& host);

// "host:port", with brackets around an IPv6 host.
std::string JoinHostPort(const std::string& host, uint16_t port);

// The local address (numeric) of the interface this host sends from toward host:port.
// Unavailable naming the destination when no route leads there or the name does not resolve.
StatusOr<std::string> OutgoingAddressToward(const std::string& host, uint16_t port);

struct AdvertiseInputs {
  bool prefill = true;
  std::optional<Advertise> advertise;  // --advertise
  std::string listen_host;             // --listen's host (prefill)
  uint16_t bound_port = 0;             // the engine's bound control port (prefill)
  std::string registry_host;           // --bootstrap
  uint16_t registry_port = 0;
};

// The control address for the registry entry (see the top of this file). InvalidArgument when
// a decode agent's --advertise gives a port (its engine listens on none).
StatusOr<std::string> AdvertisedControlAddress(const AdvertiseInputs& in);

}  // namespace kvt::tools
