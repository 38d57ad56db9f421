#include "dcr/status.h"

#include <cerrno>
#include <cstring>

namespace dcr {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kAlreadyExists: return "ALREADY_EXISTS";
    case Code::kPermissionDenied: return "PERMISSION_DENIED";
    case Code::kOutOfRange: return "OUT_OF_RANGE";
    case Code::kFailedPrecondition: return "FAILED_PRECONDITION";
    case Code::kAborted: return "ABORTED";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kDataLoss: return "DATA_LOSS";
    case Code::kUnimplemented: return "UNIMPLEMENTED";
    case Code::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(CodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
Status AlreadyExists(std::string m) { return {Code::kAlreadyExists, std::move(m)}; }
Status PermissionDenied(std::string m) { return {Code::kPermissionDenied, std::move(m)}; }
Status OutOfRange(std::string m) { return {Code::kOutOfRange, std::move(m)}; }
Status FailedPrecondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }
Status Aborted(std::string m) { return {Code::kAborted, std::move(m)}; }
Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
Status DeadlineExceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
Status DataLoss(std::string m) { return {Code::kDataLoss, std::move(m)}; }
Status Unimplemented(std::string m) { return {Code::kUnimplemented, std::move(m)}; }
Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }

Status ErrnoError(int err, std::string_view what) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  Code code = Code::kInternal;
  switch (err) {
    case ENOENT:
    case ENOTDIR: code = Code::kNotFound; break;
    case EEXIST:
    case ENOTEMPTY: code = Code::kAlreadyExists; break;
    case EACCES:
    case EPERM: code = Code::kPermissionDenied; break;
    case EROFS:
    case EISDIR:
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
    case EFBIG: code = Code::kInvalidArgument; break;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EAGAIN:
    case EINTR:
    case EBUSY:
    case EMFILE:
    case ENFILE:
    case ETIMEDOUT:
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE: code = Code::kUnavailable; break;
    case EIO: code = Code::kDataLoss; break;
    default: break;
  }
  return Status(code, std::move(m));
}

}  // namespace dcr
