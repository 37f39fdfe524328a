#include "advertise.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace kvt::tools {
namespace {

// Closes a socket descriptor on every path.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

bool IsWildcardHost(const std::string& host) {
  if (host.empty()) return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6);
  return false;
}

std::string JoinHostPort(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

StatusOr<Advertise> ParseAdvertise(const std::string& text) {
  Advertise out;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || (close + 1 < text.size() && text[close + 1] != ':')) {
      return InvalidArgument(
          "--advertise '" + text +
          "' is not HOST[:PORT] (an IPv6 host goes in brackets: [fd00::5]:7000)");
    }
    out.host = text.substr(1, close - 1);
    if (close + 1 < text.size()) port = text.substr(close + 2);
    if (close + 1 < text.size() && port.empty()) port = "(none)";
  } else if (std::count(text.begin(), text.end(), ':') == 1) {
    const size_t colon = text.find(':');
    out.host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (port.empty()) port = "(none)";
  } else {
    out.host = text;  // a name, an IPv4 address or a bare IPv6 address
  }
  if (out.host.empty() || IsWildcardHost(out.host)) {
    return InvalidArgument("--advertise '" + text + "': " +
                           (out.host.empty() ? std::string("no host")
                                             : "'" + out.host + "' is a wildcard, not an address") +
                           "; give the host name or address other hosts reach this agent at, "
                           "e.g. --advertise 10.0.0.5 or --advertise node-3:7000");
  }
  if (!port.empty()) {
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(port.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || value < 1 || value > 65535) {
      return InvalidArgument("--advertise '" + text + "': port '" + port +
                             "' is not a number in 1..65535; leave it out to advertise the bound "
                             "control port");
    }
    out.port = static_cast<uint16_t>(value);
  }
  return out;
}

StatusOr<std::string> OutgoingAddressToward(const std::string& host, uint16_t port) {
  const std::string where = JoinHostPort(host, port);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    return Unavailable("cannot resolve '" + host + "' to find the interface toward " + where +
                       ": " + gai_strerror(rc) + "; give --advertise HOST[:PORT]");
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found, &freeaddrinfo);
  std::string last_error = "no address";
  for (const addrinfo* a = addresses.get(); a != nullptr; a = a->ai_next) {
    Fd sock{::socket(a->ai_family, a->ai_socktype, a->ai_protocol)};
    if (sock.fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    // A UDP connect only picks the route and the local address; nothing is sent.
    if (::connect(sock.fd, a->ai_addr, a->ai_addrlen) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::getsockname(sock.fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        local.ss_family == AF_INET6
            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr)
            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr);
    if (inet_ntop(local.ss_family, raw, text, sizeof(text)) == nullptr) {
      last_error = std::strerror(errno);
      continue;
    }
    return std::string(text);
  }
  return Unavailable("no route from this host toward " + where + " (" + last_error +
                     "), so the address to advertise is unknown; give --advertise HOST[:PORT]");
}

StatusOr<std::string> AdvertisedControlAddress(const AdvertiseInputs& in) {
  if (!in.prefill && in.advertise && in.advertise->port) {
    return InvalidArgument("--advertise " + JoinHostPort(in.advertise->host, *in.advertise->port) +
                           ": a decode agent's engine accepts no connections, so it advertises "
                           "no port; give --advertise " +
                           in.advertise->host);
  }
  const uint16_t port =
      !in.prefill ? 0 : (in.advertise && in.advertise->port ? *in.advertise->port : in.bound_port);
  if (in.advertise) return JoinHostPort(in.advertise->host, port);
  if (in.prefill && !IsWildcardHost(in.listen_host)) return JoinHostPort(in.listen_host, port);
  // A wildcard listen address (or a decode agent, which listens nowhere): the interface that
  // leads to the registry is the one its other clients reach this host by.
  StatusOr<std::string> host = OutgoingAddressToward(in.registry_host, in.registry_port);
  if (!host.ok()) {
    return host.status().WithContext(in.prefill
                                         ? "--listen " + in.listen_host + " is a wildcard address"
                                         : std::string("a decode agent's address"));
  }
  return JoinHostPort(*host, port);
}

}  // namespace kvt::tools
