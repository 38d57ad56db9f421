// A root relay pulling frame objects from the store (docs/relay.md, "The root
// pulls from the store").
#include <fmt/format.h>

#include <set>
#include <thread>

#include "dcr/relay.h"
#include "dcr/run_keys.h"
#include "dcr/run_records.h"

namespace dcr {

namespace {
struct Announced {
  std::string_view leaf;  // the record's name in its attempt
  std::set<std::string>* seen;  // attempt prefixes handed on
  bool fence;  // Fence, else Notice
};
}  // namespace

Status PullFrameObjects(Store& store, FrameObjectSink& sink, std::chrono::milliseconds every,
                        const std::function<bool()>& stop, const std::function<void(const std::string&)>& log) {
  std::optional<uint64_t> version;  // the version being pulled: the one after the newest committed
  std::set<std::string> pulled, fenced, opened, manifested;
  uint64_t errors = 0;
  auto note = [&](const Status& s) {
    if (++errors <= 20 || errors % 1000 == 0) log(fmt::format("pulling from {}: {}", store.url(), s.ToString()));
  };
  while (!(stop && stop())) {
    auto state = ReadRunState(store);
    if (!state.ok()) {
      note(state.status());
    } else if (state->run) {
      const uint64_t v = state->latest ? *state->latest + 1 : 0;
      if (version != v) {
        version = v;
        pulled.clear();  // objects of older versions are never listed again
        fenced.clear();
        opened.clear();
        manifested.clear();
        if (state->latest) sink.Notice(run_keys::Commit(*state->latest));
      }
      auto listing = store.List(run_keys::Attempts(v));
      if (!listing.ok()) note(listing.status());
      for (const auto& o : listing.ok() ? *listing : std::vector<ObjectInfo>{}) {
        // An attempt's records, each handed on once: a notice when it opens
        // and when its manifest is in, a fence when it is fenced.
        for (const Announced& r :
             {Announced{"attempt.json", &opened, false}, Announced{kManifestFileName, &manifested, false},
              Announced{"fence", &fenced, true}}) {
          if (o.key.size() <= r.leaf.size() || !o.key.ends_with(r.leaf)) continue;
          const std::string prefix = o.key.substr(0, o.key.size() - r.leaf.size());
          if (!ValidateAttemptPrefix(prefix).ok() || !r.seen->insert(prefix).second) continue;
          if (r.fence) sink.Fence(prefix);
          else sink.Notice(prefix);
        }
        auto prefix = FrameObjectPrefix(o.key);
        if (!prefix.ok() || fenced.count(*prefix) || pulled.count(o.key)) continue;
        auto bytes = store.Get(o.key);
        if (!bytes.ok()) {
          note(bytes.status());  // listed but not readable yet, or a store failure: next round
          continue;
        }
        pulled.insert(o.key);
        sink.Object(o.key, *bytes);
      }
    }
    std::this_thread::sleep_for(every);
  }
  return Status::Ok();
}

}  // namespace dcr
