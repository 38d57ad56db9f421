// Metrics: the process's Prometheus text, and its HTTP endpoint.
#include "dcr/metrics.h"
#include "bindings.h"

namespace dcr_python {

namespace {

// The endpoints this process serves, with the address each was asked for:
// each serves until the interpreter exits.
using Served = std::vector<std::pair<std::string, std::unique_ptr<dcr::MetricsServer>>>;
Served& Servers() {
  static auto* servers = new Served;
  return *servers;
}

}  // namespace

void BindMetrics(nb::module_& m) {
  m.def(
      "metrics_text", [] { return dcr::MetricsText(); },
      "Every metric family of this process, as GET /metrics returns them.");
  m.def(
      "serve_metrics",
      [](const std::string& address) {
        // The same fixed address twice: the endpoint already there.
        for (const auto& [asked, server] : Servers())
          if (asked == address && !address.ends_with(":0")) return server->url();
        dcr::Result<std::unique_ptr<dcr::MetricsServer>> started = dcr::Unavailable("not started");
        {
          nb::gil_scoped_release release;
          started = dcr::MetricsServer::Start(address);
        }
        Servers().emplace_back(address, Take(std::move(started)));
        return Servers().back().second->url();
      },
      "address"_a, "Serves the metrics at http://HOST:PORT/metrics until the process exits; returns that URL.");
}

}  // namespace dcr_python
