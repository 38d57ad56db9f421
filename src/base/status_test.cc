#include "dcr/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace dcr {
namespace {

constexpr Code kAllCodes[] = {
    Code::kOk,       Code::kInvalidArgument,  Code::kNotFound,         Code::kAlreadyExists, Code::kFailedPrecondition,
    Code::kAborted,  Code::kUnavailable,      Code::kDeadlineExceeded, Code::kDataLoss,      Code::kUnimplemented,
    Code::kInternal, Code::kPermissionDenied, Code::kOutOfRange,
};

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), Code::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_EQ(s, Status::Ok());
}

TEST(StatusTest, CodeNamesAreDistinctAndUpperSnake) {
  std::set<std::string> names;
  for (Code c : kAllCodes) {
    const std::string name(CodeName(c));
    EXPECT_FALSE(name.empty());
    EXPECT_NE(name, "UNKNOWN");
    for (char ch : name) EXPECT_TRUE((ch >= 'A' && ch <= 'Z') || ch == '_') << name;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), std::size(kAllCodes));
  EXPECT_EQ(CodeName(Code::kOk), "OK");
  EXPECT_EQ(CodeName(Code::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(CodeName(Code::kNotFound), "NOT_FOUND");
  EXPECT_EQ(CodeName(Code::kAlreadyExists), "ALREADY_EXISTS");
  EXPECT_EQ(CodeName(Code::kFailedPrecondition), "FAILED_PRECONDITION");
  EXPECT_EQ(CodeName(Code::kAborted), "ABORTED");
  EXPECT_EQ(CodeName(Code::kUnavailable), "UNAVAILABLE");
  EXPECT_EQ(CodeName(Code::kDeadlineExceeded), "DEADLINE_EXCEEDED");
  EXPECT_EQ(CodeName(Code::kDataLoss), "DATA_LOSS");
  EXPECT_EQ(CodeName(Code::kUnimplemented), "UNIMPLEMENTED");
  EXPECT_EQ(CodeName(Code::kInternal), "INTERNAL");
}

TEST(StatusTest, ConstructorsSetCodeAndMessage) {
  struct Case {
    Status (*make)(std::string);
    Code code;
  };
  const Case cases[] = {
      {InvalidArgument, Code::kInvalidArgument},
      {NotFound, Code::kNotFound},
      {AlreadyExists, Code::kAlreadyExists},
      {FailedPrecondition, Code::kFailedPrecondition},
      {Aborted, Code::kAborted},
      {Unavailable, Code::kUnavailable},
      {DeadlineExceeded, Code::kDeadlineExceeded},
      {DataLoss, Code::kDataLoss},
      {Unimplemented, Code::kUnimplemented},
      {Internal, Code::kInternal},
  };
  for (const auto& c : cases) {
    const Status s = c.make("boom 42");
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), c.code);
    EXPECT_EQ(s.message(), "boom 42");
    EXPECT_EQ(s.ToString(), std::string(CodeName(c.code)) + ": boom 42");
  }
}

TEST(StatusTest, ToStringWithEmptyMessage) {
  EXPECT_EQ(NotFound("").ToString(), "NOT_FOUND: ");
  EXPECT_EQ(Status(Code::kDataLoss, "x").ToString(), "DATA_LOSS: x");
}

TEST(StatusTest, Equality) {
  EXPECT_EQ(NotFound("a"), NotFound("a"));
  EXPECT_NE(NotFound("a"), NotFound("b"));
  EXPECT_NE(NotFound("a"), InvalidArgument("a"));
  EXPECT_NE(Status::Ok(), Internal(""));
}

TEST(StatusTest, WithContextPrefixesMessageAndKeepsCode) {
  const Status s = DataLoss("crc mismatch").WithContext("frame 3").WithContext("v7");
  EXPECT_EQ(s.code(), Code::kDataLoss);
  EXPECT_EQ(s.message(), "v7: frame 3: crc mismatch");
  EXPECT_EQ(s.ToString(), "DATA_LOSS: v7: frame 3: crc mismatch");
}

TEST(StatusTest, WithContextOnOkIsNoOp) {
  const Status s = Status::Ok().WithContext("ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, WithContextDoesNotModifyOriginal) {
  const Status original = Aborted("lost race");
  const Status wrapped = original.WithContext("commit");
  EXPECT_EQ(original.message(), "lost race");
  EXPECT_EQ(wrapped.message(), "commit: lost race");
}

TEST(StatusTest, ErrnoErrorMapping) {
  struct Case {
    int err;
    Code code;
  };
  const Case cases[] = {
      {ENOENT, Code::kNotFound},
      {ENOTDIR, Code::kNotFound},
      {EEXIST, Code::kAlreadyExists},
      {ENOTEMPTY, Code::kAlreadyExists},
      {EACCES, Code::kPermissionDenied},
      {EPERM, Code::kPermissionDenied},
      {EROFS, Code::kInvalidArgument},
      {EISDIR, Code::kInvalidArgument},
      {EINVAL, Code::kInvalidArgument},
      {ENAMETOOLONG, Code::kInvalidArgument},
      {ELOOP, Code::kInvalidArgument},
      {EFBIG, Code::kInvalidArgument},
      {ENOSPC, Code::kUnavailable},
      {EDQUOT, Code::kUnavailable},
      {ENOMEM, Code::kUnavailable},
      {EAGAIN, Code::kUnavailable},
      {EINTR, Code::kUnavailable},
      {EBUSY, Code::kUnavailable},
      {EMFILE, Code::kUnavailable},
      {ENFILE, Code::kUnavailable},
      {ETIMEDOUT, Code::kUnavailable},
      {ECONNREFUSED, Code::kUnavailable},
      {ECONNRESET, Code::kUnavailable},
      {EPIPE, Code::kUnavailable},
      {EIO, Code::kDataLoss},
      {EXDEV, Code::kInternal},
      {EDOM, Code::kInternal},
  };
  for (const auto& c : cases) {
    const Status s = ErrnoError(c.err, "open /x/y");
    EXPECT_EQ(s.code(), c.code) << "errno " << c.err << " (" << std::strerror(c.err) << ")";
    EXPECT_EQ(s.message(), std::string("open /x/y: ") + std::strerror(c.err));
  }
}

TEST(StatusTest, ErrnoErrorIsNeverOk) {
  for (int err = 0; err < 140; ++err) EXPECT_FALSE(ErrnoError(err, "op").ok()) << err;
}

TEST(ResultTest, HoldsValue) {
  Result<int> r = 42;
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.status().ok());
  EXPECT_EQ(r.value(), 42);
  EXPECT_EQ(*r, 42);
  *r = 7;
  EXPECT_EQ(r.value(), 7);
}

TEST(ResultTest, HoldsError) {
  Result<int> r = NotFound("no such tensor");
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status(), NotFound("no such tensor"));
}

TEST(ResultTest, FromOkStatusBecomesInternal) {
  Result<std::string> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInternal);
  EXPECT_FALSE(r.status().message().empty());
}

TEST(ResultTest, ArrowAndMoveOut) {
  Result<std::string> r = std::string("hello");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 5u);
  const Result<std::string>& cr = r;
  EXPECT_EQ(cr->front(), 'h');
  EXPECT_EQ(*cr, "hello");
  std::string moved = std::move(r).value();
  EXPECT_EQ(moved, "hello");
}

TEST(ResultTest, MoveOnlyValue) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = *std::move(r);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(*p, 5);
}

// --- macros -------------------------------------------------------------

Status FailIf(bool fail, int* calls) {
  ++*calls;
  return fail ? Unavailable("flaky") : Status::Ok();
}

Status TwoSteps(bool fail_first, bool fail_second, int* calls, int* reached_end) {
  DCR_RETURN_IF_ERROR(FailIf(fail_first, calls));
  DCR_RETURN_IF_ERROR(FailIf(fail_second, calls));
  ++*reached_end;
  return Status::Ok();
}

TEST(MacrosTest, ReturnIfErrorPropagatesFirstFailure) {
  int calls = 0, end = 0;
  EXPECT_TRUE(TwoSteps(false, false, &calls, &end).ok());
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(end, 1);

  calls = end = 0;
  const Status s = TwoSteps(true, false, &calls, &end);
  EXPECT_EQ(s, Unavailable("flaky"));
  EXPECT_EQ(calls, 1);  // the second step never ran
  EXPECT_EQ(end, 0);

  calls = end = 0;
  EXPECT_EQ(TwoSteps(false, true, &calls, &end).code(), Code::kUnavailable);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(end, 0);
}

Result<int> Parse(int v) {
  if (v < 0) return InvalidArgument("negative: " + std::to_string(v));
  return v * 2;
}

Status ReturnIfErrorOnResult(int v, int* evaluations) {
  DCR_RETURN_IF_ERROR(((*evaluations)++, Parse(v)));
  return Status::Ok();
}

TEST(MacrosTest, ReturnIfErrorAcceptsResultAndEvaluatesOnce) {
  int evaluations = 0;
  EXPECT_TRUE(ReturnIfErrorOnResult(3, &evaluations).ok());
  EXPECT_EQ(evaluations, 1);
  const Status s = ReturnIfErrorOnResult(-4, &evaluations);
  EXPECT_EQ(evaluations, 2);
  EXPECT_EQ(s, InvalidArgument("negative: -4"));
}

Result<int> Sum(int a, int b, int* reached) {
  DCR_ASSIGN_OR_RETURN(int x, Parse(a));
  ++*reached;
  DCR_ASSIGN_OR_RETURN(const int y, Parse(b));  // two on consecutive lines
  ++*reached;
  return x + y;
}

TEST(MacrosTest, AssignOrReturn) {
  int reached = 0;
  Result<int> ok = Sum(1, 2, &reached);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 6);
  EXPECT_EQ(reached, 2);

  reached = 0;
  Result<int> first = Sum(-1, 2, &reached);
  EXPECT_EQ(first.status(), InvalidArgument("negative: -1"));
  EXPECT_EQ(reached, 0);

  reached = 0;
  Result<int> second = Sum(1, -2, &reached);
  EXPECT_EQ(second.status(), InvalidArgument("negative: -2"));
  EXPECT_EQ(reached, 1);
}

Result<std::unique_ptr<std::string>> MakeBox(bool fail) {
  if (fail) return DataLoss("torn");
  return std::make_unique<std::string>("box");
}

Status AssignExisting(bool fail, std::unique_ptr<std::string>* out) {
  std::unique_ptr<std::string> p;
  DCR_ASSIGN_OR_RETURN(p, MakeBox(fail));  // assigns an existing variable
  *out = std::move(p);
  return Status::Ok();
}

TEST(MacrosTest, AssignOrReturnMovesAndAssignsExistingVariable) {
  std::unique_ptr<std::string> out;
  ASSERT_TRUE(AssignExisting(false, &out).ok());
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(*out, "box");
  out.reset();
  EXPECT_EQ(AssignExisting(true, &out), DataLoss("torn"));
  EXPECT_EQ(out, nullptr);
}

Status LoopWithMacros(const std::vector<int>& values, int* total) {
  for (int v : values) {
    DCR_ASSIGN_OR_RETURN(int doubled, Parse(v));
    *total += doubled;
  }
  return Status::Ok();
}

TEST(MacrosTest, AssignOrReturnInsideLoop) {
  int total = 0;
  EXPECT_TRUE(LoopWithMacros({1, 2, 3}, &total).ok());
  EXPECT_EQ(total, 12);
  total = 0;
  EXPECT_EQ(LoopWithMacros({1, -5, 3}, &total).code(), Code::kInvalidArgument);
  EXPECT_EQ(total, 2);
}

Result<std::string> Outer(int v) {
  DCR_RETURN_IF_ERROR(Parse(v).status().WithContext("outer"));
  return std::string("fine");
}

TEST(MacrosTest, ReturnIfErrorFromResultReturningFunction) {
  EXPECT_EQ(*Outer(1), "fine");
  const Result<std::string> r = Outer(-1);
  EXPECT_EQ(r.status(), InvalidArgument("outer: negative: -1"));
}

}  // namespace
}  // namespace dcr
