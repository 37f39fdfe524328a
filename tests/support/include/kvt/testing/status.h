// gtest assertions on kvt::Status and kvt::StatusOr: on failure they print the expression and
// the status, and the ASSERT forms return from the test.
#pragma once

#include <gtest/gtest.h>

#include <utility>

#include "kvt/common/status.h"

// Fails the test (and returns) when `expr`, a Status, is not OK.
#define KVT_ASSERT_OK(expr)                                                   \
  do {                                                                        \
    const ::kvt::Status kvt_status_ = (expr);                                 \
    ASSERT_TRUE(kvt_status_.ok()) << #expr << ": " << kvt_status_.ToString(); \
  } while (false)

// Fails the test (and goes on) when `expr`, a Status, is not OK.
#define KVT_EXPECT_OK(expr)                                                   \
  do {                                                                        \
    const ::kvt::Status kvt_status_ = (expr);                                 \
    EXPECT_TRUE(kvt_status_.ok()) << #expr << ": " << kvt_status_.ToString(); \
  } while (false)

// `lhs = value of expr` (a StatusOr), or fails the test and returns.
#define KVT_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  KVT_ASSERT_OK_AND_ASSIGN_IMPL_(KVT_STATUS_CONCAT_(kvt_test_statusor_, __LINE__), lhs, expr)
#define KVT_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)               \
  auto tmp = (expr);                                                 \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()
