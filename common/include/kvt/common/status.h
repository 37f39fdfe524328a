// kvt::Status and kvt::StatusOr<T>: the result of every fallible operation in kvt.
//
// A Status is a code plus a message. Codes follow Abseil's retry meaning:
//   kInvalidArgument    the caller's input is wrong (fix the call; retrying will not help)
//   kFailedPrecondition the object is in the wrong state for this call (fix the state first)
//   kOutOfRange         an index or size outside the valid range
//   kNotFound           a named thing (request, peer, layer) does not exist
//   kAlreadyExists      a thing that must be unique exists already
//   kResourceExhausted  out of memory, pages, credits (retry later, or with less)
//   kUnavailable        a peer or device cannot be reached now (retry the call)
//   kAborted            the operation was cancelled (retry higher up)
//   kDeadlineExceeded   the operation's deadline passed
//   kUnimplemented      not supported by this build or backend
//   kDataLoss           bytes were corrupted (a verification failed)
//   kInternal           a broken invariant inside kvt (a bug)
//   kInProgress         not an error: the operation has not finished yet
//
// Thread safety: Status and StatusOr are values; distinct objects may be used from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvt {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,
  kFailedPrecondition,
  kOutOfRange,
  kNotFound,
  kAlreadyExists,
  kResourceExhausted,
  kUnavailable,
  kAborted,
  kDeadlineExceeded,
  kUnimplemented,
  kDataLoss,
  kInternal,
  kInProgress,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "InvalidArgument: <message>", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

inline Status OkStatus() { return Status(); }
Status InvalidArgument(std::string message);
Status FailedPrecondition(std::string message);
Status OutOfRange(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status ResourceExhausted(std::string message);
Status Unavailable(std::string message);
Status Aborted(std::string message);
Status DeadlineExceeded(std::string message);
Status Unimplemented(std::string message);
Status DataLoss(std::string message);
Status Internal(std::string message);
Status InProgress(std::string message = "in progress");

// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const T& value) : value_(value) {}             // NOLINT: implicit by design
  StatusOr(T&& value) : value_(std::move(value)) {}       // NOLINT
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = Internal("StatusOr constructed from an OK Status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  // Precondition: ok(). Accessing the value of a failed StatusOr aborts the process.
  T& value() & {
    CheckOk();
    return *value_;
  }
  const T& value() const& {
    CheckOk();
    return *value_;
  }
  T&& value() && {
    CheckOk();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void CheckOk() const;

  Status status_;
  std::optional<T> value_;
};

[[noreturn]] void DieOnBadStatusOrAccess(const Status& status);

template <typename T>
void StatusOr<T>::CheckOk() const {
  if (!value_.has_value()) DieOnBadStatusOrAccess(status_);
}

}  // namespace kvt

#define KVT_STATUS_CONCAT_INNER_(a, b) a##b
#define KVT_STATUS_CONCAT_(a, b) KVT_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define KVT_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kvt::Status kvt_status_ = (expr);        \
    if (!kvt_status_.ok()) return kvt_status_; \
  } while (false)

// `lhs = value of expr` (a StatusOr), or returns its Status from the enclosing function.
#define KVT_ASSIGN_OR_RETURN(lhs, expr) \
  KVT_ASSIGN_OR_RETURN_IMPL_(KVT_STATUS_CONCAT_(kvt_statusor_, __LINE__), lhs, expr)
#define KVT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
