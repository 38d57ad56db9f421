// Errors as values. The core never throws: every fallible call returns a
// Status or a Result<T>. The code tells the caller what to do next:
//   retry the call     -> kUnavailable, kDeadlineExceeded
//   retry the attempt  -> kAborted, kDataLoss (a corrupt frame can be re-fetched)
//   stop and report    -> everything else
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace dcr {

enum class Code : uint8_t {
  kOk = 0,
  kInvalidArgument,  // the caller's input is malformed (bad file, bad flag)
  kNotFound,  // a named file, key or tensor does not exist
  kAlreadyExists,  // a create-if-absent found the object present
  kPermissionDenied,  // credentials rejected or access denied
  kOutOfRange,  // a read past the end of an object or file
  kFailedPrecondition,  // the system is not in the state the call needs (wrong base)
  kAborted,  // a concurrent actor won (fenced attempt, lost race)
  kUnavailable,  // transient: a service or connection failed; retry
  kDeadlineExceeded,  // a deadline passed; retry may succeed
  kDataLoss,  // stored bytes are corrupt or truncated
  kUnimplemented,  // not supported (unknown format version, dtype op)
  kInternal,  // a bug in dcr
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "NOT_FOUND: message", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: message" (no-op when OK).
  Status WithContext(std::string_view context) const;

  // Explicitly discard a status whose failure does not matter.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) { return a.code_ == b.code_ && a.message_ == b.message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status PermissionDenied(std::string message);
Status OutOfRange(std::string message);
Status FailedPrecondition(std::string message);
Status Aborted(std::string message);
Status Unavailable(std::string message);
Status DeadlineExceeded(std::string message);
Status DataLoss(std::string message);
Status Unimplemented(std::string message);
Status Internal(std::string message);
// errno-based error: maps ENOENT to kNotFound, EEXIST to kAlreadyExists,
// ENOSPC/EIO to kUnavailable/kDataLoss, etc. Message: "what: strerror".
Status ErrnoError(int err, std::string_view what);

// Result<T> holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status(Code::kInternal, "Result built from OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  // Precondition: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

namespace internal {
inline Status AsStatus(Status s) { return s; }
template <typename T>
Status AsStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace dcr

#define DCR_CONCAT_INNER_(a, b) a##b
#define DCR_CONCAT_(a, b) DCR_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function when `expr` (a Status or a
// Result) is not OK.
#define DCR_RETURN_IF_ERROR(expr)                                  \
  do {                                                             \
    ::dcr::Status dcr_status_ = ::dcr::internal::AsStatus((expr)); \
    if (!dcr_status_.ok()) return dcr_status_;                     \
  } while (0)

// DCR_ASSIGN_OR_RETURN(auto x, MakeX()); declares/assigns x from a Result or
// returns its Status.
#define DCR_ASSIGN_OR_RETURN(lhs, expr) DCR_ASSIGN_OR_RETURN_IMPL_(DCR_CONCAT_(dcr_result_, __LINE__), lhs, expr)
#define DCR_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
