// Metric families and their text exposition (include/dcr/metrics.h).
#include "dcr/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace dcr {

namespace {

struct Registry {
  std::mutex mu;
  std::vector<const MetricFamily*> families;
};

Registry& TheRegistry() {
  static Registry* r = new Registry;  // never destroyed: families outlive static destruction order
  return *r;
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

// A label value with \, " and newline escaped.
std::string Escaped(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// `{a="x",b="y"}` (with `extra` last), or "" without labels.
std::string LabelText(const std::vector<std::string>& names, const std::vector<std::string>& values,
                      std::string_view extra = {}) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += fmt::format("{}{}=\"{}\"", out.empty() ? "" : ",", names[i], Escaped(values[i]));
  if (!extra.empty()) out += fmt::format("{}{}", out.empty() ? "" : ",", extra);
  return out.empty() ? "" : "{" + out + "}";
}

std::string HelpEscaped(std::string_view help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

}  // namespace

MetricFamily::MetricFamily(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
                           std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)),
      bounds_(std::move(buckets)) {
  if (label_names_.empty()) series_[{}].buckets.assign(bounds_.size(), 0);
  Registry& r = TheRegistry();
  std::lock_guard lock(r.mu);
  r.families.push_back(this);
}

MetricFamily::~MetricFamily() {
  Registry& r = TheRegistry();
  std::lock_guard lock(r.mu);
  std::erase(r.families, this);
}

MetricFamily::Series* MetricFamily::Find(LabelValues values) {
  if (values.size() != label_names_.size()) return nullptr;
  std::vector<std::string> key(values.begin(), values.end());
  auto [it, added] = series_.try_emplace(std::move(key));
  if (added) it->second.buckets.assign(bounds_.size(), 0);
  return &it->second;
}

template <typename F>
void MetricFamily::Update(LabelValues values, F update) {
  std::lock_guard lock(mu_);
  if (Series* s = Find(values)) update(*s);
}

std::string MetricFamily::Text() const {
  static constexpr const char* kTypes[] = {"counter", "gauge", "histogram"};
  std::string out =
      fmt::format("# HELP {} {}\n# TYPE {} {}\n", name_, HelpEscaped(help_), name_, kTypes[static_cast<int>(type_)]);
  std::lock_guard lock(mu_);
  for (const auto& [values, s] : series_) {
    if (type_ != MetricType::kHistogram) {
      out += fmt::format("{}{} {}\n", name_, LabelText(label_names_, values), Number(s.value));
      continue;
    }
    for (size_t b = 0; b < bounds_.size(); ++b)
      out += fmt::format("{}_bucket{} {}\n", name_,
                         LabelText(label_names_, values, fmt::format("le=\"{}\"", Number(bounds_[b]))), s.buckets[b]);
    out += fmt::format("{}_bucket{} {}\n", name_, LabelText(label_names_, values, "le=\"+Inf\""), s.count);
    out += fmt::format("{}_sum{} {}\n", name_, LabelText(label_names_, values), Number(s.value));
    out += fmt::format("{}_count{} {}\n", name_, LabelText(label_names_, values), s.count);
  }
  return out;
}

void Counter::Add(double by, LabelValues values) {
  if (!(by >= 0)) return;
  Update(values, [by](Series& s) { s.value += by; });
}

void Counter::Mirror(double total, LabelValues values) {
  Update(values, [total](Series& s) { s.value = std::max(s.value, total); });
}

void Gauge::Set(double value, LabelValues values) {
  Update(values, [value](Series& s) { s.value = value; });
}

void Histogram::Observe(double value, LabelValues values) {
  if (std::isnan(value)) return;
  Update(values, [&](Series& s) {
    s.value += value;
    ++s.count;
    for (size_t b = 0; b < s.buckets.size(); ++b) s.buckets[b] += value <= BoundAt(b) ? 1 : 0;
  });
}

std::vector<double> Histogram::SecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
}

std::string MetricsText() {
  Registry& r = TheRegistry();
  // Held while the families are read: none is destroyed meanwhile (at exit).
  std::lock_guard lock(r.mu);
  std::vector<const MetricFamily*> families = r.families;
  std::sort(families.begin(), families.end(),
            [](const MetricFamily* a, const MetricFamily* b) { return a->name() < b->name(); });
  std::string out;
  for (const MetricFamily* f : families) out += f->Text();
  return out;
}

}  // namespace dcr
